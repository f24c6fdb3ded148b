"""`forklift bench ...`: benchmarks that write markdown, JSON and a chart to --out-dir.

Each benchmark is one sub-subcommand: add its parser here with an `_add_<name>` function and
call it from `add_bench_parser`.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (reports go to --out-dir)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_memory(bench_sub)
    _add_throughput(bench_sub)


def _add_memory(bench_sub: argparse._SubParsersAction) -> None:
    memory = bench_sub.add_parser(
        "memory", help="KV memory wasted by contiguous reservation vs paged blocks"
    )
    memory.add_argument("--quick", action="store_true", help="a shorter measured run")
    memory.add_argument("--out-dir", default="benchmarks")
    memory.add_argument("--model", default=None, help="HF model dir or GGUF file (default model)")
    memory.add_argument(
        "--budget-gib", type=float, default=None, help="at-scale KV budget (default: 16 requests)"
    )
    memory.set_defaults(func=_cmd_memory)


def _cmd_memory(args: argparse.Namespace) -> int:
    from forklift.bench.memory import run_memory_bench, summary

    if args.budget_gib is not None and args.budget_gib <= 0:
        raise ValueError(f"--budget-gib must be > 0, got {args.budget_gib}")
    command = ["forklift", "bench", "memory", "--out-dir", args.out_dir]
    command += ["--quick"] if args.quick else []
    command += ["--model", args.model] if args.model else []
    command += ["--budget-gib", str(args.budget_gib)] if args.budget_gib is not None else []
    report = run_memory_bench(
        Path(args.out_dir), shlex.join(command), args.quick, args.model, args.budget_gib
    )
    print(summary(report))
    return 0


def _add_throughput(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "throughput", help="offline output tok/s: forklift vs HF generate() static batches"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument(
        "--output-lengths", default=None, help="comma-separated, cycled (default 32,64,128,512)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_throughput)


def _cmd_throughput(args: argparse.Namespace) -> int:
    from forklift.bench.throughput import (
        ThroughputSettings,
        render_markdown,
        run_throughput,
        write_report,
    )

    overrides: dict[str, Any] = {"model": args.model, "dtype": args.dtype}
    if args.num_requests is not None:
        overrides["num_requests"] = args.num_requests
    if args.output_lengths is not None:
        overrides["output_lengths"] = tuple(int(n) for n in args.output_lengths.split(","))
    if args.hf_batch_size is not None:
        overrides["hf_batch_size"] = args.hf_batch_size
    if args.max_model_len is not None:
        overrides["max_model_len"] = args.max_model_len
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    settings = (ThroughputSettings.quick if args.quick else ThroughputSettings)(**overrides)
    report = run_throughput(settings)
    command = "forklift bench throughput" + (" --quick" if args.quick else "")
    for path in write_report(report, Path(args.out_dir), command):
        print(f"wrote {path}")
    print(render_markdown({**report, "command": command}))
    return 0
