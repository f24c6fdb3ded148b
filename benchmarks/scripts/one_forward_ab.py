"""One forward for every step against a revision before it, side by side on the default
model: prefill, offline throughput, batch-8 decode, resident weights, and how often a
temperature-0 answer changes with what shares its batch or what the cache holds.

Each measurement runs in a fresh process per revision (the revision's checkout first on
PYTHONPATH), the revisions alternating round by round; the report gives each round's
ratio and their median.

    .venv/bin/python benchmarks/scripts/one_forward_ab.py --baseline 2ef5837 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
from pathlib import Path

from results import command_line, write_results
from revision_build import ROOT, revision_worktree, run_in_tree

from forklift.bench.report import cpu_flags

# What one child process measures; it prints one JSON object.
CHILD = r"""
import json, os, resource, statistics, sys, time
import numpy as np
from forklift import LLM, SamplingParams
from forklift.bench.workload import offline_mixed

kind = sys.argv[1]
llm = LLM(max_model_len=2048, enable_prefix_caching=False)
runner = llm.llm_engine.runner
result = {"weight_bytes": runner.weight_bytes,
          "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
rng = np.random.default_rng(0)
one = SamplingParams(max_tokens=1, temperature=0)
if kind == "prefill":
    times = []
    for _ in range(4):
        prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, 512)]}
                   for _ in range(4)]
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    result["tok_s"] = 4 * 512 / statistics.median(times[1:])
elif kind == "offline":
    work = offline_mixed(32, (128,))
    convs = [[{"role": "user", "content": text}] for text, _ in work]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.chat(convs[:4], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["tok_s"] = tokens / (time.perf_counter() - start)
elif kind.startswith("decode"):
    # decodeN: N sequences decoding 128 tokens at a context of 564: the time with 129 output
    # tokens less the time with one (the same prefill, no cache).
    batch = int(kind.removeprefix("decode"))
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, 564)]}
               for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    spans = {}
    for tokens in (1, 129):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        spans[tokens] = time.perf_counter() - start
    result["tok_s"] = batch * 128 / (spans[129] - spans[1])
elif kind == "invariance":
    # The same temperature-0 chat turn alone, beside 7 others, and after a request that left
    # part of it in the prefix cache: how many of the comparisons differ.
    cached = LLM(max_model_len=2048, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=24, temperature=0)
    work = offline_mixed(10, (24,))
    differ = 0
    for i, (text, _) in enumerate(work):
        conv = [{"role": "user", "content": text}]
        alone = llm.chat([conv], params, use_tqdm=False)[0].outputs[0].text
        others = [[{"role": "user", "content": t}] for t, _ in work[:i] + work[i + 1:i + 8]]
        batched = llm.chat([conv] + others, params, use_tqdm=False)[0].outputs[0].text
        cached.chat([[{"role": "user", "content": text + " Please."}]], params, use_tqdm=False)
        hit = cached.chat([conv], params, use_tqdm=False)[0].outputs[0].text
        differ += (batched != alone) + (hit != alone)
    result["differ"] = differ
    result["comparisons"] = 2 * len(work)
print("RESULT " + json.dumps(result))
"""

# decodeN takes any batch size N (decode32: the 32-row steps of an offline batch).
KINDS = ("prefill", "offline", "decode1", "decode8", "invariance")


def llama_bench_rate(binary: str, prompt: int, generate: int, depth: int = 0) -> float:
    """llama-bench's tok/s on the default model's file, 2 threads: prefill of `prompt` tokens
    (generate 0) or decode of `generate` (prompt 0), after `depth` tokens of context."""
    from forklift.checkpoint.source import resolve_model

    done = subprocess.run(
        [binary, "-m", str(resolve_model(None).path), "-t", "2", "-p", str(prompt), "-n",
         str(generate), "-d", str(depth), "-fa", "0", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(json.loads(done.stdout)[0]["avg_ts"])


def llama_bench_pp512(binary: str) -> float:
    """llama-bench's prefill tok/s of 512 tokens on the default model's file, 2 threads."""
    return llama_bench_rate(binary, 512, 0)


def run_child(tree: Path, kind: str) -> dict:
    return run_in_tree(tree, CHILD, kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    parser.add_argument("--name", default="one-forward")
    parser.add_argument("--llama-bench", help="llama-bench's path: its pp512 each round")
    parser.add_argument(
        "--title",
        default="One forward for every step, against the split paths before it",
        help="the report's heading",
    )
    parser.add_argument("--label", default="one forward", help="this tree's column")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    with revision_worktree(args.baseline) as baseline:
        rounds = {kind: [] for kind in kinds}
        for round_index in range(args.rounds):
            for kind in kinds:
                if kind == "invariance" and round_index:
                    continue  # a count, not a speed: once is enough
                pair = {"baseline": run_child(baseline, kind), "this": run_child(ROOT, kind)}
                if kind == "prefill" and args.llama_bench:
                    pair["llama_bench"] = {"tok_s": llama_bench_pp512(args.llama_bench)}
                rounds[kind].append(pair)
                print(kind, json.dumps(pair), flush=True)
    lines = [
        f"# {args.title}",
        "",
        f"Baseline: revision {args.baseline}, alternating with this tree, {args.rounds} rounds "
        "(each measurement a fresh process). prefill: 4 prompts of 512 random tokens, one "
        "output token (median of 3 after a warm-up); offline: 32 chat requests x 128 tokens "
        "(offline-mixed); decodeN: N sequences at a context of 564 decoding 128 "
        "tokens (the time with 129 output tokens less the time with one); "
        "invariance: 10 chat turns of 24 tokens at temperature 0, each alone against beside 7 "
        "others and after a request that left part of it in the prefix cache.",
        "",
        f"| what | before | {args.label} | ratio, median (rounds) |",
        "|---|---|---|---|",
    ]
    for kind in kinds:
        if kind == "invariance":
            sides = [rounds[kind][0][side] for side in ("baseline", "this")]
            cells = [f"{r['differ']} of {r['comparisons']}" for r in sides]
            lines.append(f"| temperature-0 answers that changed | {cells[0]} | {cells[1]} | |")
            continue
        ratios = [p["this"]["tok_s"] / p["baseline"]["tok_s"] for p in rounds[kind]]
        base = statistics.median(p["baseline"]["tok_s"] for p in rounds[kind])
        this = statistics.median(p["this"]["tok_s"] for p in rounds[kind])
        lines.append(
            f"| {kind} tok/s | {base:.1f} | {this:.1f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    if args.llama_bench and "prefill" in kinds:
        pairs = rounds["prefill"]
        peer = statistics.median(p["llama_bench"]["tok_s"] for p in pairs)
        ratios = [p[side]["tok_s"] / p["llama_bench"]["tok_s"] for p in pairs
                  for side in ("baseline", "this")]  # fmt: skip
        before, after = ratios[0::2], ratios[1::2]
        lines.append(
            f"| prefill against llama-bench pp512 ({peer:.1f} tok/s) | "
            f"{statistics.median(before):.2f}x | {statistics.median(after):.2f}x | |"
        )
    first = rounds[kinds[0]][0]
    mib = [first[side]["weight_bytes"] / 2**20 for side in ("baseline", "this")]
    rss = [first[side]["rss_bytes"] / 2**20 for side in ("baseline", "this")]
    lines.append(
        f"| weights the memory plan counts | {mib[0]:.1f} MiB | {mib[1]:.1f} MiB | "
        f"{mib[1] / mib[0]:.2f}x |"
    )
    lines.append(
        f"| peak resident size after start-up ({kinds[0]}) | {rss[0]:.0f} MiB | "
        f"{rss[1]:.0f} MiB | {rss[1] / rss[0]:.2f}x |"
    )
    lines.append("")
    report = {"cpu_flags": sorted(cpu_flags()), "baseline": args.baseline, "rounds": rounds}
    words = ["--baseline", args.baseline, "--rounds", args.rounds, "--kinds", args.kinds,
             "--out-dir", args.out_dir.resolve(), "--name", args.name,
             "--title", shlex.quote(args.title), "--label", shlex.quote(args.label)]  # fmt: skip
    if args.llama_bench:
        words += ["--llama-bench", "LLAMA_BENCH"]
    command = command_line(__file__, *words)
    if os.environ.get("FORKLIFT_CPU_KIND"):
        command = f"FORKLIFT_CPU_KIND={os.environ['FORKLIFT_CPU_KIND']} {command}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.out_dir, args.name, report, lines, command)


if __name__ == "__main__":
    main()
