"""Precise weights' wide rows against a revision before them, side by side on the default
model's GGUF file: with --weight down (twelve-bit rows of a q4 weight), 30 layers' down
projections (576 x 1536, random Q4 blocks) at 1-512 rows; with --weight head (sixteen-bit
rows of a q8 weight), the LM head's shape (49152 x 576, random Q8 blocks) at 1-64 rows; in
the AVX2 build at 1 and 32 (two int8 rows either way up to 4fc5c38, which gave that build
sixteen-bit rows of a q8 weight of its own); then one stream decoding after 564
tokens, one 730-token prompt's first token, 4 x 512 prefill, and 8 and 32 sequences
decoding.

Each revision runs in a fresh process (its checkout first on PYTHONPATH), the revisions
alternating round by round and which goes first alternating too; the report gives the
medians and each round's ratio. With --llama-bench, llama-bench's pp512 and tg128 on the
same file each round (tg128 at depth 564, as the stream).

    .venv/bin/python benchmarks/scripts/wide_precise_ab.py --baseline b90edf0 \
        --llama-bench LLAMA_BENCH [--weight head --name NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from one_forward_ab import llama_bench_rate
from results import command_line, write_results
from revision_build import ROOT, ab_row, revision_worktree, run_in_tree

from forklift.bench.report import cpu_flags

# One child process: every measurement; prints one JSON object.
CHILD = r"""
import json, statistics, sys, time
import numpy as np
import torch
from forklift import LLM, SamplingParams
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.native.quant_matmul import QuantMatmulKernel

result = {}
WEIGHT = sys.argv[1]  # "down" or "head"


# Random precise weights through `kernel` (30 Q4 down projections, or one Q8 LM head): ms per
# pass, by rows.
def time_weights(kernel, row_counts, prefix):
    torch.manual_seed(0)
    if WEIGHT == "down":
        weights = [BlockInt4.from_dense(torch.randn(576, 1536), kernel, precise=True)
                   for _ in range(30)]
    else:
        weights = [BlockInt8.from_dense(torch.randn(49152, 576), kernel, precise=True)]
    for rows in row_counts:
        x = torch.randn(rows, weights[0].shape[1])
        times = []
        for _ in range(9):
            start = time.perf_counter()
            for weight in weights:
                weight.linear(x)
            times.append(time.perf_counter() - start)
        result[f"{prefix}{WEIGHT}_{rows}_ms"] = 1e3 * statistics.median(times[1:])


time_weights(QuantMatmulKernel.load(), ROWS[WEIGHT], "")
time_weights(QuantMatmulKernel.load(("-march=x86-64-v3",)), (1, 32), "avx2_")

llm = LLM(max_model_len=2048, enable_prefix_caching=False)
rng = np.random.default_rng(0)


def prompts(count, length):
    return [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, length)]}
            for _ in range(count)]


def timed(batch, params):
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start


one = SamplingParams(max_tokens=1, temperature=0)
llm.generate(prompts(1, 730), one, use_tqdm=False)
stream = prompts(1, 564)
spans = {t: statistics.median(timed(stream, SamplingParams(max_tokens=t, temperature=0,
                                                          ignore_eos=True)) for _ in range(3))
         for t in (1, 129)}
result["stream_tok_s"] = 128 / (spans[129] - spans[1])
result["first_token_ms"] = 1e3 * statistics.median(timed(prompts(1, 730), one) for _ in range(6))
result["prefill_tok_s"] = 4 * 512 / statistics.median(
    [timed(prompts(4, 512), one) for _ in range(4)][1:])
for count in (8, 32):
    batch = prompts(count, 96)
    spans = {t: timed(batch, SamplingParams(max_tokens=t, temperature=0, ignore_eos=True))
             for t in (1, 129)}
    result[f"decode{count}_tok_s"] = count * 128 / (spans[129] - spans[1])
print("RESULT " + json.dumps(result))
"""

# Each weight's row counts, its label, and what the revision before took and this tree takes.
ROWS = {"down": (1, 8, 32, 128, 512), "head": (1, 4, 8, 16, 32, 64)}
WEIGHTS = {
    "down": ("30 down projections", "q4", "the down projection's rows as two int8 rows",
             "one wide row of twelve-bit codes"),
    "head": ("LM head", "q8", "the LM head's rows as two int8 rows",
             "one wide row of sixteen-bit codes, split in two dot products"),
}  # fmt: skip


def measures(weight: str) -> dict[str, tuple[str, bool]]:
    label = WEIGHTS[weight][0]
    return {
        **{f"{weight}_{rows}_ms": (f"{label}, {rows} rows (ms)", False) for rows in ROWS[weight]},
        **{f"avx2_{weight}_{rows}_ms": (f"... AVX2 build, {rows} rows (ms)", False)
           for rows in (1, 32)},
        "stream_tok_s": ("one stream decoding 128 tokens after 564 (tok/s)", True),
        "first_token_ms": ("one 730-token prompt: first token (ms)", False),
        "prefill_tok_s": ("prefill, 4 x 512 tokens (tok/s)", True),
        "decode8_tok_s": ("8 sequences decoding 128 tokens after 96 (tok/s)", True),
        "decode32_tok_s": ("32 sequences decoding 128 tokens after 96 (tok/s)", True),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--llama-bench", help="llama-bench's path: pp512 and tg128 each round")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    parser.add_argument("--name", default="wide-precise-rows")
    parser.add_argument("--weight", choices=sorted(WEIGHTS), default="down")
    args = parser.parse_args()
    child = CHILD.replace("ROWS[WEIGHT]", repr(ROWS[args.weight]))
    pairs: list[dict] = []
    peer: dict[str, list[float]] = {"pp512": [], "tg128": []}
    with revision_worktree(args.baseline) as baseline:
        for round_index in range(args.rounds):
            # The second process of a pair measured up to a tenth slower, whichever tree.
            sides = [("baseline", baseline), ("this", ROOT)]
            if round_index % 2:
                sides.reverse()
            pair = {side: run_in_tree(tree, child, args.weight) for side, tree in sides}
            pairs.append(pair)
            print(json.dumps(pair), flush=True)
            if args.llama_bench:
                peer["pp512"].append(llama_bench_rate(args.llama_bench, 512, 0))
                peer["tg128"].append(llama_bench_rate(args.llama_bench, 0, 128, 564))
    label, form, before, now = WEIGHTS[args.weight]
    shape = (
        "30 random 576 x 1536 Q4 weights"
        if args.weight == "down"
        else ("one random 49152 x 576 Q8 weight")
    )
    lines = [
        f"# Precise {form} rows: this tree against the revision before it",
        "",
        f"Baseline: revision {args.baseline} ({before}), alternating with this tree ({now}), "
        f"{args.rounds} rounds, each side a fresh process, which side goes first alternating "
        "round by round. The default model's GGUF file (Q4_1 layers, a Q8_0 head). "
        f"{label}: {shape}, median of 8 passes (the AVX2 build: this CPU running x86-64-v3 "
        "code); one stream: a 564-token prompt, the time with 129 output tokens less the time "
        "with one (median of 3); first token: one prompt of 730 random tokens (median of 6 "
        "after a warm-up); prefill: 4 prompts of 512 (median of 3 after a warm-up); 8 and 32 "
        "sequences: prompts of 96 tokens, 129 output tokens less one.",
        "",
        "| measure | before | this tree | ratio, median (rounds) |",
        "|---|---|---|---|",
    ]
    for key, (label, higher_is_better) in measures(args.weight).items():
        lines.append(f"| {label} | {ab_row(pairs, key, higher_is_better)} |")
    lines += ["", "Ratios: above 1 means this tree is faster (times: before / after)."]
    if args.llama_bench:
        pp512, tg128 = statistics.median(peer["pp512"]), statistics.median(peer["tg128"])
        ratio = {
            side: (
                statistics.median(p[side]["prefill_tok_s"] for p in pairs) / pp512,
                statistics.median(p[side]["stream_tok_s"] for p in pairs) / tg128,
            )
            for side in ("baseline", "this")
        }
        lines += [
            "",
            f"llama-bench on the same file, 2 threads, the same rounds: pp512 {pp512:.1f} tok/s, "
            f"tg128 at depth 564 {tg128:.1f} tok/s. forklift's 4 x 512 prefill "
            f"{ratio['baseline'][0]:.2f}x pp512 before, {ratio['this'][0]:.2f}x now; one "
            "stream's decode "
            f"{ratio['baseline'][1]:.2f}x tg128 before, {ratio['this'][1]:.2f}x now.",
        ]
    lines.append("")
    report = {"cpu_flags": sorted(cpu_flags()), "baseline": args.baseline, "rounds": pairs,
              "llama_bench": peer}  # fmt: skip
    words: list[object] = ["--baseline", args.baseline, "--rounds", args.rounds,
                           "--out-dir", args.out_dir.resolve(), "--name", args.name,
                           "--weight", args.weight]  # fmt: skip
    if args.llama_bench:
        words += ["--llama-bench", "LLAMA_BENCH"]
    write_results(args.out_dir, args.name, report, lines, command_line(__file__, *words))


if __name__ == "__main__":
    main()
