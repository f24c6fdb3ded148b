"""forklift against llama.cpp on a 3B-shaped Q4_K_M file (make_large_gguf.py makes it):
resident memory at the same context size, weights the memory plan counts, prefill of 512
tokens and single-stream decode, side by side in one run (llama-bench and llama-server for
llama.cpp, fresh processes each).

    .venv/bin/python benchmarks/scripts/large_gguf.py \\
        --model OUT_DIR/llama-3b-random.Q4_K_M.gguf --llama-cpp $HOME/.cache/llama-cpp
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT

from forklift.bench.report import cpu_flags

CONTEXT = 4096
# layers x (K, V) x KV heads x head size x bf16 (forklift's cache on every CPU by default)
KV_BYTES_PER_TOKEN_3B = 28 * 2 * 8 * 128 * 2

# One forklift process: load, one short request, then prefill and decode timings.
CHILD = r"""
import json, sys, time
import numpy as np
from forklift import LLM, SamplingParams
path, context, kv_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
llm = LLM(model=path, max_model_len=context, kv_cache_memory_bytes=kv_bytes,
          enable_prefix_caching=False)
load_s = time.perf_counter() - start
rng = np.random.default_rng(0)
prompt = [int(t) for t in rng.integers(100, 40000, 512)]
def timed(tokens):
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start
timed(1)
prefill = min(timed(1) for _ in range(2))
decode = timed(65) - prefill
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
print("RESULT " + json.dumps({
    "load_s": load_s, "weight_bytes": llm.llm_engine.runner.weight_bytes, "rss_bytes": rss,
    "prefill_tok_s": 512 / prefill, "decode_tok_s": 64 / decode,
}))
"""


def forklift_run(model: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(CONTEXT),
         str((CONTEXT + 32) * KV_BYTES_PER_TOKEN_3B)],  # (+ the null block)
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def llama_bench(binary: Path, model: Path) -> dict:
    done = subprocess.run(
        [str(binary), "-m", str(model), "-t", "2", "-p", "512", "-n", "64", "-fa", "0",
         "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(done.stdout)
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return {"prefill_tok_s": speed["prefill"], "decode_tok_s": speed["decode"]}


def llama_server_rss(binary: Path, model: Path) -> int:
    """Resident bytes of llama-server at CONTEXT tokens after one short completion."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(binary), "-m", str(model), "-t", "2", "-c", str(CONTEXT), "-np", "1", "--port",
         str(port), "-fa", "off", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"prompt": "Once upon a time", "n_predict": 8}).encode()
        request = urllib.request.Request(url + "/completion", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(request, timeout=600).read()
        status = Path(f"/proc/{server.pid}/status").read_text()
        return (
            int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]) * 1024
        )
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    args = parser.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    ours = forklift_run(args.model)
    print("forklift", ours, flush=True)
    peer = llama_bench(bin_dir / "llama-bench", args.model)
    print("llama-bench", peer, flush=True)
    peer["rss_bytes"] = llama_server_rss(bin_dir / "llama-server", args.model)
    print("llama-server rss", peer["rss_bytes"], flush=True)
    size = args.model.stat().st_size
    gib = 2**30
    lines = [
        "# A 3B-shaped Q4_K_M file: forklift against llama.cpp",
        "",
        f"File: {args.model.name}, {size / gib:.2f} GiB (random weights, Llama 3.2 3B shapes "
        "with the default model's vocabulary; benchmarks/scripts/make_large_gguf.py). Both "
        f"engines on 2 threads, context {CONTEXT} tokens. Prefill: one 512-token prompt "
        "(llama-bench pp512); decode: 64 tokens after it (llama-bench tg64, from an empty "
        "context). Resident memory: after one request (llama-server -c 4096 -np 1, its "
        "fp16 cache; forklift with a KV cache of 4096 tokens in "
        "bf16).",
        "",
        "| what | forklift | llama.cpp | ratio |",
        "|---|---|---|---|",
        f"| resident memory | {ours['rss_bytes'] / gib:.2f} GiB | {peer['rss_bytes'] / gib:.2f} "
        f"GiB | {ours['rss_bytes'] / peer['rss_bytes']:.2f}x |",
        f"| weights in the memory plan | {ours['weight_bytes'] / gib:.2f} GiB | file "
        f"{size / gib:.2f} GiB | {ours['weight_bytes'] / size:.2f}x |",
        f"| prefill tok/s | {ours['prefill_tok_s']:.1f} | {peer['prefill_tok_s']:.1f} | "
        f"{ours['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x |",
        f"| decode tok/s | {ours['decode_tok_s']:.2f} | {peer['decode_tok_s']:.2f} | "
        f"{ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x |",
        f"| forklift start-up | {ours['load_s']:.0f} s | | |",
        "",
    ]
    report = {"cpu_flags": sorted(cpu_flags()), "forklift": ours, "llama_cpp": peer,
              "file_bytes": size, "context": CONTEXT}  # fmt: skip
    model = f"OUT_DIR/{args.model.name}"  # the folder make_large_gguf.py wrote it to
    command = command_line(__file__, "--model", model, "--llama-cpp", "LLAMA_CPP_DIR")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.out_dir, "large-gguf", report, lines, command)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
