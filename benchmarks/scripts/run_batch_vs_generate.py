"""`forklift run-batch` against `LLM.chat` on the same N chat requests: output tokens per
second of each (model loading left out of both), and whether their answers agree.

The batch file holds the offline-mixed workload's instructions as chat requests at
temperature 0 with `ignore_eos`, so both sides generate the same tokens. Each round runs
`forklift run-batch` in a process of its own (its rate is the one it reports, timed from
the loaded model to the last answer), then `LLM.chat` on the prompts in this process. The
target: run-batch at 0.95x LLM.chat's rate or better. Writes <out-dir>/<name>.{md,json}.

Run: .venv/bin/python benchmarks/scripts/run_batch_vs_generate.py [--num-requests 256]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results import command_line, write_results
from revision_build import ROOT

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags
from forklift.bench.workload import DEFAULT_OUTPUT_LENGTHS, offline_mixed

# The summary line run-batch ends with: "... N output tokens, R tok/s".
_SUMMARY = re.compile(r"(\d+) output tokens, ([\d.]+) tok/s")


def lscpu_flags() -> list[str]:
    """Every flag `lscpu` lists (empty where there is no lscpu)."""
    if shutil.which("lscpu") is None:
        return []
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    for line in text.splitlines():
        if line.startswith("Flags:"):
            return line.split(":", 1)[1].split()
    return []


def batch_lines(workload: list[tuple[str, int]]) -> list[dict[str, Any]]:
    lines = []
    for i, (instruction, length) in enumerate(workload):
        body = {"messages": [{"role": "user", "content": instruction}], "max_tokens": length,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        lines.append({"custom_id": f"request-{i}", "method": "POST",
                      "url": "/v1/chat/completions", "body": body})  # fmt: skip
    return lines


def table_row(side: str, rates: list[float]) -> str:
    rounds = ", ".join(f"{r:.1f}" for r in rates)
    return f"| {side} | {statistics.median(rates):.1f} | {rounds} |"


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs)]
    return flags + (["--model", args.model] if args.model else [])


def time_run_batch(args: argparse.Namespace, source: Path, work: Path) -> dict[str, Any]:
    output = work / "output.jsonl"
    output.unlink(missing_ok=True)
    command = [sys.executable, "-m", "forklift", "--log-level", "WARNING", "run-batch", "-i",
               str(source), "-o", str(output), "--no-progress", *engine_flags(args)]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"run-batch failed:\n{done.stderr}")
    match = _SUMMARY.search(done.stderr)
    if match is None:
        raise RuntimeError(f"no summary line in run-batch's stderr:\n{done.stderr}")
    texts = {}
    for line in output.read_text().splitlines():
        record = json.loads(line)
        texts[record["custom_id"]] = record["response"]["body"]["choices"][0]["message"]["content"]
    return {"output_tokens": int(match.group(1)), "tok_s": float(match.group(2)),
            "wall_s_with_load": wall, "texts": texts}  # fmt: skip


def time_llm_chat(llm: LLM, lines: list[dict[str, Any]]) -> dict[str, Any]:
    conversations = [line["body"]["messages"] for line in lines]
    params = [SamplingParams(temperature=0, max_tokens=line["body"]["max_tokens"],
                             ignore_eos=True) for line in lines]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    texts = {line["custom_id"]: o.outputs[0].text for line, o in zip(lines, outputs, strict=True)}
    return {"output_tokens": tokens, "tok_s": tokens / elapsed, "elapsed_s": elapsed,
            "texts": texts}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--output-lengths",
        default=",".join(map(str, DEFAULT_OUTPUT_LENGTHS)),
        help="output tokens of the requests, cycled (comma-separated)",
    )
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--name", default="run-batch-vs-generate")
    args = parser.parse_args()
    lengths = tuple(int(n) for n in args.output_lengths.split(","))
    lines = batch_lines(offline_mixed(args.num_requests, lengths))
    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs)
    batch_rates, chat_rates, agree = [], [], True
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "input.jsonl"
        source.write_text("".join(json.dumps(line) + "\n" for line in lines))
        for _ in range(args.rounds):
            batch = time_run_batch(args, source, work)
            chat = time_llm_chat(llm, lines)
            if batch["output_tokens"] != chat["output_tokens"]:
                raise RuntimeError(f"output tokens differ: {batch['output_tokens']} vs "
                                   f"{chat['output_tokens']}")  # fmt: skip
            agree = agree and batch["texts"] == chat["texts"]
            batch_rates.append(batch["tok_s"])
            chat_rates.append(chat["tok_s"])
    ratio = statistics.median(batch_rates) / statistics.median(chat_rates)
    report = {
        "num_requests": args.num_requests,
        "rounds": args.rounds,
        "model": args.model or "default",
        "max_num_seqs": args.max_num_seqs,
        "output_lengths": list(lengths),
        "output_tokens": chat["output_tokens"],
        "run_batch_tok_s": batch_rates,
        "llm_chat_tok_s": chat_rates,
        "ratio_median": ratio,
        "target_ratio": 0.95,
        "answers_equal": agree,
        "cpu_flags": cpu_flags(),
        "lscpu_flags": lscpu_flags(),
    }
    table = [
        f"# forklift run-batch vs LLM.chat, {args.num_requests} chat requests",
        "",
        f"{chat['output_tokens']} output tokens a round (temperature 0, ignore_eos), "
        f"{args.rounds} rounds; model loading left out of both rates.",
        "",
        "| side | output tok/s (median) | rounds |",
        "|---|---|---|",
        table_row("`forklift run-batch`", batch_rates),
        table_row("`LLM.chat`", chat_rates),
        "",
        f"Ratio run-batch / LLM.chat: **{ratio:.3f}x** (target 0.95x or better); "
        f"answers identical: {'yes' if agree else 'NO'}.",
        "",
    ]
    words = ["--num-requests", args.num_requests, "--rounds", args.rounds, "--output-lengths",
             args.output_lengths, "--max-num-seqs", args.max_num_seqs]  # fmt: skip
    if args.model:
        words += ["--model", args.model]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.out_dir, args.name, report, table, command_line(__file__, *words))


if __name__ == "__main__":
    main()
