"""Attention on tiles against a revision before it, side by side on the default model's GGUF
file and on the bf16 directory made from it: one 730-token prompt's first token, 4 x 512
prefill, and 32 sequences decoding, each with the native step's attention seconds.

Each (model, revision) runs in a fresh process (the revision's checkout first on
PYTHONPATH), the revisions alternating round by round; the report gives the medians and
each round's ratio. With --llama-bench, llama-bench's pp512 on the GGUF file each round.

    .venv/bin/python benchmarks/scripts/attention_ab.py --baseline 2d27019 \
        --bf16-dir $SMOLLM2_HF --llama-bench LLAMA_BENCH
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from one_forward_ab import llama_bench_pp512
from results import command_line, write_results
from revision_build import ROOT, ab_row, revision_worktree, run_in_tree

from forklift.bench.report import cpu_flags

# One child process: every measurement on one model; prints one JSON object.
CHILD = r"""
import json, statistics, sys, time
import numpy as np
from forklift import LLM, SamplingParams

model = sys.argv[1] or None
llm = LLM(model=model, max_model_len=2048, enable_prefix_caching=False)
step = llm.llm_engine.runner.native_step
rng = np.random.default_rng(0)
one = SamplingParams(max_tokens=1, temperature=0)


def prompts(count, length):
    return [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, length)]}
            for _ in range(count)]


def timed(batch, params):
    step.start_timing()
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, step.stop_timing().attention


result = {}
llm.generate(prompts(1, 730), one, use_tqdm=False)
first = [timed(prompts(1, 730), one) for _ in range(6)]
result["first_token_ms"] = 1e3 * statistics.median(t for t, _ in first)
result["first_token_attention_ms"] = 1e3 * statistics.median(a for _, a in first)
fill = [timed(prompts(4, 512), one) for _ in range(4)][1:]
result["prefill_tok_s"] = 4 * 512 / statistics.median(t for t, _ in fill)
result["prefill_attention_ms"] = 1e3 * statistics.median(a for _, a in fill)
batch = prompts(32, 96)
spans = {}
for tokens in (1, 129):
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    spans[tokens] = timed(batch, params)
result["decode32_tok_s"] = 32 * 128 / (spans[129][0] - spans[1][0])
result["decode32_attention_ms_per_step"] = 1e3 * (spans[129][1] - spans[1][1]) / 128
print("RESULT " + json.dumps(result))
"""

MEASURES = {
    "first_token_ms": ("one 730-token prompt: first token (ms)", False),
    "first_token_attention_ms": ("... its attention (ms)", False),
    "prefill_tok_s": ("prefill, 4 x 512 tokens (tok/s)", True),
    "prefill_attention_ms": ("... its attention (ms)", False),
    "decode32_tok_s": ("32 sequences decoding 128 tokens after 96 (tok/s)", True),
    "decode32_attention_ms_per_step": ("... attention per step (ms)", False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16-dir", help="the bf16 HF directory made from the GGUF file")
    parser.add_argument("--llama-bench", help="llama-bench's path: its pp512 each round")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    parser.add_argument("--name", default="attention-tiles-ab")
    args = parser.parse_args()
    models = {"GGUF file": ""}
    if args.bf16_dir:
        models["bf16 directory"] = args.bf16_dir
    rounds: dict[str, list[dict]] = {name: [] for name in models}
    peer: list[float] = []
    with revision_worktree(args.baseline) as baseline:
        for round_index in range(args.rounds):
            for name, model in models.items():
                # Which side runs first alternates: the second process of a pair measured
                # up to a tenth slower, whichever tree it was.
                sides = [("baseline", baseline), ("this", ROOT)]
                if round_index % 2:
                    sides.reverse()
                pair = {side: run_in_tree(tree, CHILD, model) for side, tree in sides}
                rounds[name].append(pair)
                print(name, json.dumps(pair), flush=True)
            if args.llama_bench:
                peer.append(llama_bench_pp512(args.llama_bench))
    lines = [
        "# Attention on tiles: this tree against the revision before it",
        "",
        f"Baseline: revision {args.baseline}, alternating with this tree, {args.rounds} "
        "rounds, each side a fresh process per model, which side goes first alternating "
        "round by round. First token: one prompt of 730 random "
        "tokens, one output token (median of 6 after a warm-up); prefill: 4 prompts of 512 "
        "(median of 3 after a warm-up); decode: 32 prompts of 96 tokens, the time with 129 "
        "output tokens less the time with one. Attention: the native step's own timer.",
        "",
        "| model | measure | before | this tree | ratio, median (rounds) |",
        "|---|---|---|---|---|",
    ]
    for name in models:
        for key, (label, higher_is_better) in MEASURES.items():
            lines.append(f"| {name} | {label} | {ab_row(rounds[name], key, higher_is_better)} |")
    lines += ["", "Ratios: above 1 means this tree is faster (times: before / after)."]
    if peer:
        pp512 = statistics.median(peer)
        gguf = rounds["GGUF file"]
        before = statistics.median(p["baseline"]["prefill_tok_s"] for p in gguf) / pp512
        after = statistics.median(p["this"]["prefill_tok_s"] for p in gguf) / pp512
        lines += [
            "",
            f"llama-bench pp512 on the same file, 2 threads, the same rounds: {pp512:.1f} tok/s; "
            f"forklift's 4 x 512 prefill {before:.2f}x it before, {after:.2f}x now.",
        ]
    lines.append("")
    report = {
        "cpu_flags": sorted(cpu_flags()),
        "baseline": args.baseline,
        "rounds": rounds,
        "llama_bench_pp512": peer,
    }
    words: list[object] = ["--baseline", args.baseline, "--rounds", args.rounds,
                           "--out-dir", args.out_dir.resolve(), "--name", args.name]  # fmt: skip
    if args.bf16_dir:
        words += ["--bf16-dir", "$SMOLLM2_HF"]
    if args.llama_bench:
        words += ["--llama-bench", "LLAMA_BENCH"]
    write_results(args.out_dir, args.name, report, lines, command_line(__file__, *words))


if __name__ == "__main__":
    main()
