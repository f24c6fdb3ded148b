"""Attention on AMX tiles, part by part: a prefill's step timers (matmuls, attention, the
rest) on this tree and on a baseline revision, and one layer's decode attention from the
same sources built with AMX and without it (the vector form), side by side in one process.

The prefill: 4 prompts of 512 random tokens on the default model, one output token, the
native step's own timers over the last of four rounds (the baseline's in a fresh process on
a worktree of its revision). The layer: a bf16 cache of 3 KV heads
x 3 query heads each at a head size of 64 (the default model's shape), 1 or 8 sequences at
564 or 2048 positions; each build timed in 12 alternating rounds of 40 calls, the fastest
round kept (the caches hot: what the tiles' own work costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from results import command_line, write_results
from revision_build import ROOT, revision_worktree

from forklift import LLM, SamplingParams
from forklift.cpu import cpu_flags
from forklift.native.build import load_native_library
from forklift.native.decode_attention_kernel import NativeDecodeAttention

VECTOR_FLAGS = ("-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
LAYER_CASES = ((1, 564), (8, 564), (8, 2048))


def prefill_timers() -> dict[str, float]:
    llm = LLM(max_model_len=2048, enable_prefix_caching=False)
    native = llm.llm_engine.runner.native_step
    generator = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for round_index in range(4):
        prompts = [
            {"prompt_token_ids": torch.randint(100, 40000, (512,), generator=generator).tolist()}
            for _ in range(4)
        ]
        if round_index == 3:
            native.start_timing()
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    timed = native.stop_timing()
    return {"tok_s": 4 * 512 / statistics.median(times[1:]), "matrix_s": timed.matrix,
            "attention_s": timed.attention, "other_s": timed.other}  # fmt: skip


def baseline_prefill_timers(revision: str) -> dict[str, float]:
    """prefill_timers on a worktree of `revision`, in a process of its own."""
    with revision_worktree(revision) as tree:
        done = subprocess.run(
            [sys.executable, __file__, "--prefill-only"], cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def layer_case(seqs: int, context: int, block_size: int = 16) -> tuple:
    generator = torch.Generator().manual_seed(0)
    kv_heads, group, head_dim = 3, 3, 64
    width = context // block_size + 1
    num_blocks = seqs * width + 1
    shape = (kv_heads, num_blocks, block_size, head_dim)
    keys = torch.randn(shape, generator=generator).bfloat16()
    values = torch.randn(shape, generator=generator).bfloat16()
    order = torch.randperm(num_blocks - 1, generator=generator)[: seqs * width]
    blocks = (1 + order).view(seqs, width)
    position = torch.arange(width * block_size)[None, :]
    bias = torch.where(position < context, 0.0, float("-inf")).expand(seqs, -1).contiguous()
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=generator).bfloat16()
    return q, keys, values, blocks, bias


def layer_times(kernels: dict[str, NativeDecodeAttention]) -> list[dict[str, float]]:
    torch.set_num_threads(2)
    rows = []
    for seqs, context in LAYER_CASES:
        args = layer_case(seqs, context)
        rounds: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(12):
            for name, kernel in kernels.items():
                for _ in range(5):
                    kernel(*args, 0.125)
                start = time.perf_counter()
                for _ in range(40):
                    kernel(*args, 0.125)
                rounds[name].append((time.perf_counter() - start) / 40 * 1e6)
        rows.append({"seqs": seqs, "context": context,
                     **{f"{name}_us": min(times) for name, times in rounds.items()}})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    parser.add_argument("--name", default="amx-attention-parts")
    parser.add_argument("--baseline", default="f994790", help="the revision before the tiles")
    parser.add_argument("--prefill-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefill_only:
        print("RESULT " + json.dumps(prefill_timers()))
        return
    tiles = NativeDecodeAttention(load_native_library("decode_attention"))
    vectors = NativeDecodeAttention(load_native_library("decode_attention", VECTOR_FLAGS))
    layers = layer_times({"tiles": tiles, "vectors": vectors})
    prefill = {"baseline": baseline_prefill_timers(args.baseline), "this": prefill_timers()}
    lines = [
        "# Attention on AMX tiles, part by part",
        "",
        "A prefill of 4 prompts x 512 random tokens (default model, one output token), the "
        f"native step's timers on the last of four rounds, revision {args.baseline} (attention "
        "on AVX-512 dot products) and this tree, each in a fresh process:",
        "",
        "| tree | tok/s | matmuls (s) | attention (s) | the rest (s) |",
        "|---|---|---|---|---|",
    ]
    for side, label in (("baseline", args.baseline), ("this", "this tree")):
        timed = prefill[side]
        lines.append(
            f"| {label} | {timed['tok_s']:.1f} | {timed['matrix_s']:.3f} | "
            f"{timed['attention_s']:.3f} | {timed['other_s']:.3f} |"
        )
    lines += [
        "",
        "One layer's decode attention (bf16 cache, 3 KV heads x 3 query heads, head size 64), "
        "the same sources built with AMX (tiles) and without it (vectors), the fastest of 12 "
        "alternating rounds of 40 calls, caches hot:",
        "",
        "| sequences | positions | tiles (us) | vectors (us) | tiles / vectors |",
        "|---|---|---|---|---|",
    ]
    for row in layers:
        lines.append(
            f"| {row['seqs']} | {row['context']} | {row['tiles_us']:.1f} | "
            f"{row['vectors_us']:.1f} | {row['tiles_us'] / row['vectors_us']:.2f}x |"
        )
    lines.append("")
    report = {"cpu_flags": sorted(cpu_flags()), "prefill": prefill, "layers": layers}
    command = command_line(__file__, "--out-dir", args.out_dir, "--name", args.name,
                           "--baseline", args.baseline)  # fmt: skip
    write_results(args.out_dir, args.name, report, lines, command)


if __name__ == "__main__":
    main()
