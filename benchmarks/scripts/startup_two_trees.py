"""Start-up time of two forklift source trees side by side, in one run, rounds interleaved.

    .venv/bin/python benchmarks/scripts/startup_two_trees.py OLD_TREE NEW_TREE OUT_PREFIX

Each round starts, for each tree, a fresh Python process that builds the default model's
engine (`LLMEngine(EngineConfig())`, the default memory budget) and one that builds a tiny
random Llama's (the default budget then holds millions of KV blocks), and a `forklift serve`
until /health answers. The trees share this virtual environment; each runs first on the path.
Writes OUT_PREFIX.md and OUT_PREFIX.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROUNDS = 3
ENGINE = """
import sys, time
start = time.perf_counter()
from forklift.config import EngineConfig
from forklift.engine.engine import LLMEngine
model = sys.argv[1] or None
LLMEngine(EngineConfig(model=model, max_model_len=512))
print(time.perf_counter() - start)
"""


def tiny_llama(directory: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def engine_seconds(tree: Path, model: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # Run outside any tree: the working directory comes first on a child's path.
    done = subprocess.run([sys.executable, "-c", ENGINE, model], env=env, capture_output=True,
                          text=True, check=True, cwd=tempfile.gettempdir())  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def serve_seconds(tree: Path, port: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "forklift.cli", "serve", "--port", str(port),
               "--max-model-len", "512"]  # fmt: skip
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())  # fmt: skip
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    old, new, prefix = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    tiny = str(tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
    cases = {"default model engine": lambda t: engine_seconds(t, ""),
             "tiny model engine": lambda t: engine_seconds(t, tiny),
             "forklift serve ready": lambda t: serve_seconds(t, 18931)}  # fmt: skip
    times: dict[str, dict[str, list[float]]] = {c: {"before": [], "after": []} for c in cases}
    for _ in range(ROUNDS):
        for case, run in cases.items():
            for side, tree in (("before", old), ("after", new)):
                times[case][side].append(run(tree))
    flags = sorted(
        {
            f
            for line in open("/proc/cpuinfo")
            if line.startswith("flags")
            for f in line.split(":")[1].split()
            if f.startswith(("avx", "amx", "fma"))
        }
    )
    rows = ["| case | before (s, median) | after (s, median) | speed-up |", "|---|---|---|---|"]
    for case, sides in times.items():
        before, after = statistics.median(sides["before"]), statistics.median(sides["after"])
        rows.append(f"| {case} | {before:.2f} | {after:.2f} | {before / after:.2f}x |")
    text = "\n".join([
        "# Start-up before and after (two source trees, one run, rounds interleaved)", "",
        "Command: `.venv/bin/python benchmarks/scripts/startup_two_trees.py OLD NEW OUT`", "",
        "Engine: a fresh process, from its first line (imports included) to the engine built;",
        "serve: from the process start to /health answering.",
        f"{ROUNDS} rounds, medians. CPU flags: {' '.join(flags)}. Before: the tree before the",
        "start-up changes; after: with them (GGUF metadata parsed in one pass, the model built",
        "with no random init off the meta device, whole-tensor dense dequantization, the",
        "profile's sampler rows allocated instead of sorted, the block pool built lazily).", "",
        *rows, "",
    ])  # fmt: skip
    prefix.with_suffix(".md").write_text(text)
    prefix.with_suffix(".json").write_text(json.dumps({"rounds": ROUNDS, "cpu_flags": flags,
                                                       "seconds": times}, indent=2))  # fmt: skip
    print(text)


if __name__ == "__main__":
    main()
