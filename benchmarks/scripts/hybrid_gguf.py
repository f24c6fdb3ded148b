"""The native hybrid step against llama.cpp and against the PyTorch layers it replaces, on
a Qwen3.5-0.8B-shaped `qwen35` file (make_hybrid_gguf.py makes it): prefill of one
512-token prompt, and single-stream decode of 128 tokens after a 564-token prompt, side by
side in one run (llama-bench for llama.cpp at its best flash-attention setting; forklift
before the native step from a git revision of this tree; fresh processes each).

    .venv/bin/python benchmarks/scripts/hybrid_gguf.py \\
        --model OUT_DIR/qwen35-0.8b-random.Q4_K_M.gguf --llama-cpp $HOME/.cache/llama-cpp \\
        --baseline REVISION
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT, revision_worktree

from forklift.bench.report import cpu_flags
from forklift.cpu import host_cpu_flags

PREFILL, DEPTH, DECODE = 512, 564, 128

# One forklift process (the tree on sys.path first): load, warm up, then prefill and decode.
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from forklift import LLM, SamplingParams
path, prefill_len, depth, decode = sys.argv[2], *map(int, sys.argv[3:6])
llm = LLM(model=path, max_model_len=2048, kv_cache_memory_bytes=256 * 2**20,
          enable_prefix_caching=False)
rng = np.random.default_rng(0)
def timed(length, tokens):
    prompt = [int(t) for t in rng.integers(100, 40000, length)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start
timed(prefill_len, 2)
prefill = min(timed(prefill_len, 1) for _ in range(3))
first = min(timed(depth, 1) for _ in range(2))
whole = min(timed(depth, decode + 1) for _ in range(2))
print("RESULT " + json.dumps({
    "decode_path": llm.llm_engine.runner.decode_path,
    "prefill_tok_s": prefill_len / prefill, "decode_tok_s": decode / (whole - first),
}))
"""


def forklift_run(tree: Path, model: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(model), str(PREFILL), str(DEPTH),
         str(DECODE)],
        cwd=tree, capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def llama_bench(binary: Path, model: Path) -> dict:
    """pp512 and tg128 at depth 564, each at llama.cpp's faster flash-attention setting."""
    best: dict = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for flash in ("0", "1"):
        for key, extra in (
            ("prefill_tok_s", ["-p", str(PREFILL), "-n", "0"]),
            ("decode_tok_s", ["-p", "0", "-n", str(DECODE), "-d", str(DEPTH)]),
        ):
            done = subprocess.run(
                [str(binary), "-m", str(model), "-t", "2", "-fa", flash, "-o", "json", *extra],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            speed = json.loads(done.stdout)[0]["avg_ts"]
            if speed > best[key]:
                best[key], best[key.replace("tok_s", "flash")] = speed, flash
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--baseline", required=True, help="the revision before the native step")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    args = parser.parse_args()
    with revision_worktree(args.baseline) as before_tree:
        before = forklift_run(before_tree, args.model)
        print("forklift before", before, flush=True)
        ours = forklift_run(ROOT, args.model)
        print("forklift", ours, flush=True)
    peer = llama_bench(args.llama_cpp / "build" / "bin" / "llama-bench", args.model)
    print("llama-bench", peer, flush=True)
    size = args.model.stat().st_size / 2**30
    quant = args.model.name.split(".")[-2]
    rows = [("prefill tok/s (512-token prompt)", "prefill_tok_s"),
            (f"decode tok/s ({DECODE} tokens after {DEPTH})", "decode_tok_s")]  # fmt: skip
    lines = [
        f"# The native hybrid step on a Qwen3.5-0.8B-shaped {quant} file",
        "",
        f"File: {args.model.name}, {size:.2f} GiB (random weights, Qwen3.5-0.8B's text shapes; "
        "benchmarks/scripts/make_hybrid_gguf.py). Every engine on 2 threads, one stream. "
        f"forklift before: revision {args.baseline[:7]}, where this family ran the PyTorch "
        f"layers ({before['decode_path']} for decode rows); now: {ours['decode_path']}. "
        f"llama.cpp: llama-bench pp{PREFILL} and tg{DECODE} at depth {DEPTH}, at its faster "
        "flash-attention setting.",
        "",
    ]
    kind = os.environ.get("FORKLIFT_CPU_KIND")
    if kind:  # (the children inherit it)
        lines += [f"forklift, before and now, built as the `{kind}` CPU kind "
                  "(FORKLIFT_CPU_KIND); llama.cpp runs its build for this CPU, whose flags are: "
                  + " ".join(sorted(host_cpu_flags())) + ".", ""]  # fmt: skip
    lines += [
        "| what | forklift | forklift before | llama.cpp | vs before | vs llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in rows:
        lines.append(
            f"| {label} | {ours[key]:.1f} | {before[key]:.1f} | {peer[key]:.1f} | "
            f"{ours[key] / before[key]:.2f}x | {ours[key] / peer[key]:.2f}x |"
        )
    lines.append("")
    report = {"cpu_flags": sorted(cpu_flags()), "forklift": ours, "forklift_before": before,
              "llama_cpp": peer, "baseline": args.baseline, "file_gib": size,
              "forklift_cpu_kind": kind, "host_cpu_flags": sorted(host_cpu_flags())}  # fmt: skip
    model = f"OUT_DIR/{args.model.name}"
    command = command_line(__file__, "--model", model, "--llama-cpp", "LLAMA_CPP_DIR",
                           "--baseline", args.baseline)  # fmt: skip
    if kind:
        command = f"FORKLIFT_CPU_KIND={kind} {command}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "hybrid-native-step-" + quant.lower().replace("_", "-")
    stem += f"-{kind}-kind" if kind else ""
    write_results(args.out_dir, stem, report, lines, command)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
