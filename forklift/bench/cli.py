"""`forklift bench ...`: benchmarks that write markdown, JSON and a chart to --out-dir.

Each benchmark is one sub-subcommand: add its parser here with an `_add_<name>` function and
call it from `add_bench_parser`.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from forklift.bench.report import announce, positive_ints
from forklift.config import QUANTIZATION_METHODS
from forklift.rl.cli import add_bench_grpo_parser


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (reports go to --out-dir)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_memory(bench_sub)
    _add_throughput(bench_sub)
    _add_serve(bench_sub)
    _add_prefix(bench_sub)
    add_bench_grpo_parser(bench_sub)
    _add_decode(bench_sub)
    _add_profile(bench_sub)
    _add_scale(bench_sub)
    _add_startup(bench_sub)
    _add_soak(bench_sub)
    _add_hybrid(bench_sub)
    _add_structured(bench_sub)


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
        overrides["output_lengths"] = positive_ints(args.output_lengths, "--output-lengths")
    if args.hf_batch_size is not None:
        overrides["hf_batch_size"] = args.hf_batch_size
    if args.max_model_len is not None:
        overrides["max_model_len"] = args.max_model_len
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    settings = (ThroughputSettings.quick if args.quick else ThroughputSettings)(**overrides)
    report = run_throughput(settings)
    command = "forklift bench throughput" + (" --quick" if args.quick else "")
    paths = write_report(report, Path(args.out_dir), command)
    announce(paths, render_markdown({**report, "command": command}))
    return 0


def _add_serve(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "serve", help="streaming load sweep against an OpenAI-compatible server"
    )
    parser.add_argument(
        "--base-url", default=None, help="server to load (default: start forklift serve)"
    )
    parser.add_argument("--model", default=None, help="local model for the prompts' tokenizer")
    parser.add_argument("--served-model", default=None, help="model name sent in requests")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--concurrency", default=None, help="comma-separated levels")
    parser.add_argument("--min-requests", type=int, default=None)
    parser.add_argument("--requests-per-concurrency", type=int, default=None)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `forklift serve` argument"
    )
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--peer-url", default=None, help="another server to load the same way")
    peer.add_argument(
        "--llama-server", default=None, help="llama.cpp's llama-server: started on the same GGUF"
    )
    parser.add_argument("--peer-threads", type=int, default=None, help="llama-server -t / -tb")
    parser.add_argument("--name", default="serve", help="report file name stem")
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from forklift.bench.serve import ServeSettings, render_markdown, run_serve_bench, write_report

    overrides: dict[str, Any] = {
        "base_url": args.base_url,
        "model": args.model,
        "served_model": args.served_model,
        "endpoint": args.endpoint,
        "api_key": args.api_key,
        "server_args": args.server_arg,
        "peer_url": args.peer_url,
        "llama_server": args.llama_server,
        "peer_threads": args.peer_threads,
    }
    optional = {
        "input_tokens": args.input_tokens,
        "output_tokens": args.output_tokens,
        "min_requests": args.min_requests,
        "requests_per_concurrency": args.requests_per_concurrency,
    }
    overrides |= {key: value for key, value in optional.items() if value is not None}
    if args.concurrency is not None:
        overrides["concurrencies"] = positive_ints(args.concurrency, "--concurrency")
    settings = (ServeSettings.quick if args.quick else ServeSettings)(**overrides)
    report = run_serve_bench(settings)
    report["command"] = _serve_command(args)
    announce(write_report(report, Path(args.out_dir), args.name), render_markdown(report))
    levels = report["levels"] + report.get("peer", {}).get("levels", [])
    failed = sum(len(level["errors"]) for level in levels)
    return 1 if failed else 0


def _serve_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (the API key is never written down)."""
    command = ["forklift", "bench", "serve"] + (["--quick"] if args.quick else [])
    flags = {
        "--base-url": args.base_url,
        "--model": args.model,
        "--served-model": args.served_model,
        "--input-tokens": args.input_tokens,
        "--output-tokens": args.output_tokens,
        "--concurrency": args.concurrency,
        "--min-requests": args.min_requests,
        "--requests-per-concurrency": args.requests_per_concurrency,
        "--peer-url": args.peer_url,
        "--peer-threads": args.peer_threads,
    }
    for flag, value in flags.items():
        command += [flag, str(value)] if value is not None else []
    command += ["--endpoint", args.endpoint] if args.endpoint != "completions" else []
    # The binary's path is this machine's; the report names the program only.
    command += ["--llama-server", "llama-server"] if args.llama_server else []
    for server_arg in args.server_arg:
        command.append(f"--server-arg={server_arg}")
    return shlex.join(command)


def _add_prefix(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "prefix", help="prefix caching on vs off; n-sample groups vs independent requests"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_prefix)


def _cmd_prefix(args: argparse.Namespace) -> int:
    from forklift.bench.prefix import (
        PrefixSettings,
        render_markdown,
        run_prefix_bench,
        write_report,
    )

    overrides = {"model": args.model, "dtype": args.dtype}
    settings = (PrefixSettings.quick if args.quick else PrefixSettings)(**overrides)
    report = run_prefix_bench(settings)
    command = ["forklift", "bench", "prefix"] + (["--quick"] if args.quick else [])
    command += ["--model", args.model] if args.model else []
    command += ["--dtype", args.dtype] if args.dtype != "auto" else []
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _add_decode(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "decode", help="decode step time by weight form and batch size vs read bandwidth"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--forms", default=None, help="comma-separated: fp32, bf16, int8, int4, int4-captured"
    )
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    parser.add_argument(
        "--llama-bench", default=None, help="llama.cpp's llama-bench binary: run it side by side"
    )
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_decode)


def _cmd_decode(args: argparse.Namespace) -> int:
    from forklift.bench.decode import (
        DecodeSettings,
        render_markdown,
        run_decode_bench,
        write_report,
    )

    overrides: dict[str, Any] = {"model": args.model, "llama_bench": args.llama_bench}
    if args.forms is not None:
        overrides["forms"] = tuple(args.forms.split(","))
    if args.batch_sizes is not None:
        overrides["batch_sizes"] = positive_ints(args.batch_sizes, "--batch-sizes")
    if args.context is not None:
        overrides["context"] = positive_ints(str(args.context), "--context")[0]
    report = run_decode_bench((DecodeSettings.quick if args.quick else DecodeSettings)(**overrides))
    command = ["forklift", "bench", "decode"] + (["--quick"] if args.quick else [])
    command += ["--model", args.model] if args.model else []
    command += ["--forms", args.forms] if args.forms else []
    command += ["--batch-sizes", args.batch_sizes] if args.batch_sizes else []
    command += ["--context", str(args.context)] if args.context else []
    command += ["--llama-bench", "llama-bench"] if args.llama_bench else []
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _add_profile(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser("profile", help="where a decode step's time goes")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="profiled decode steps per size")
    parser.add_argument("--context", type=int, default=564, help="prompt tokens per request")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_METHODS)
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    from forklift.bench.step_profile import render_markdown, run_profile_bench, write_report

    sizes = positive_ints(args.batch_sizes, "--batch-sizes")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    context = positive_ints(str(args.context), "--context")[0]
    report = run_profile_bench(
        args.model, args.dtype, sizes, args.steps, context, args.quantization
    )
    command = ["forklift", "bench", "profile", "--batch-sizes", args.batch_sizes]
    command += ["--steps", str(args.steps), "--context", str(context)]
    command += ["--quantization", args.quantization] if args.quantization != "auto" else []
    command += ["--model", args.model] if args.model else []
    command += ["--dtype", args.dtype] if args.dtype != "auto" else []
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _add_scale(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "scale", help="one engine vs TP=2 vs DP=2 serving, and TP all-reduce arithmetic"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_scale)


def _cmd_scale(args: argparse.Namespace) -> int:
    from forklift.bench.scale import ScaleSettings, render_markdown, run_scale_bench, write_report

    settings = ScaleSettings(
        model=args.model,
        concurrencies=positive_ints(args.concurrency, "--concurrency"),
        output_tokens=args.output_tokens,
    )
    report = run_scale_bench(settings)
    command = ["forklift", "bench", "scale", "--concurrency", args.concurrency]
    command += ["--output-tokens", str(args.output_tokens)]
    command += ["--model", args.model] if args.model else []
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _add_startup(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser("startup", help="forklift serve time to ready, cold and warm")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_startup)


def _cmd_startup(args: argparse.Namespace) -> int:
    from forklift.bench.startup import render_markdown, run_startup_bench, write_report

    report = run_startup_bench(args.model)
    command = ["forklift", "bench", "startup"] + (["--model", args.model] if args.model else [])
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _add_soak(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "soak", help="many mixed requests and dropped streams: no errors, no leaked blocks"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument(
        "--disconnect-share", type=float, default=None, help="share of streams dropped"
    )
    parser.add_argument("--quick", action="store_true", help="a small run (under a minute)")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_soak)


def _cmd_soak(args: argparse.Namespace) -> int:
    from forklift.bench.soak import SoakSettings, render_markdown, run_soak, write_report

    overrides: dict[str, Any] = {"model": args.model}
    for name in ("num_requests", "concurrency", "disconnect_share"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    report = run_soak((SoakSettings.quick if args.quick else SoakSettings)(**overrides))
    command = ["forklift", "bench", "soak"] + (["--quick"] if args.quick else [])
    command += ["--model", args.model] if args.model else []
    for name in ("num_requests", "concurrency", "disconnect_share"):
        if getattr(args, name) is not None:
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0 if report["errors"] == 0 and report["final_kv_usage"] == 0 else 1


def _add_hybrid(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "hybrid", help="a Qwen3.5 hybrid vs its all-attention twin: prefill and decode"
    )
    parser.add_argument("--dtypes", default=None, help="comma-separated: float32,bfloat16")
    parser.add_argument("--contexts", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="toy models, seconds")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_hybrid)


def _cmd_hybrid(args: argparse.Namespace) -> int:
    from forklift.bench.hybrid import (
        HybridSettings,
        render_markdown,
        run_hybrid_bench,
        write_report,
    )

    overrides: dict[str, Any] = {}
    if args.dtypes is not None:
        overrides["dtypes"] = tuple(args.dtypes.split(","))
    if args.contexts is not None:
        overrides["contexts"] = positive_ints(args.contexts, "--contexts")
    if args.batch_sizes is not None:
        overrides["batch_sizes"] = positive_ints(args.batch_sizes, "--batch-sizes")
    settings = (HybridSettings.quick if args.quick else HybridSettings)(**overrides)
    report = run_hybrid_bench(settings)
    command = ["forklift", "bench", "hybrid"] + (["--quick"] if args.quick else [])
    for flag, value in (("--dtypes", args.dtypes), ("--contexts", args.contexts),
                        ("--batch-sizes", args.batch_sizes)):  # fmt: skip
        command += [flag, value] if value else []
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _add_structured(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser(
        "structured", help="decode under a JSON schema vs free text, batch 1 and 8"
    )
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="a few tokens, seconds")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_structured)


def _cmd_structured(args: argparse.Namespace) -> int:
    from forklift.bench.structured import (
        StructuredSettings,
        render_markdown,
        run_structured_bench,
        write_report,
    )

    overrides: dict[str, Any] = {"model": args.model}
    if args.batch_sizes is not None:
        overrides["batch_sizes"] = positive_ints(args.batch_sizes, "--batch-sizes")
    settings = (StructuredSettings.quick if args.quick else StructuredSettings)(**overrides)
    report = run_structured_bench(settings)
    command = ["forklift", "bench", "structured"] + (["--quick"] if args.quick else [])
    for flag, value in (("--model", args.model), ("--batch-sizes", args.batch_sizes)):
        command += [flag, value] if value else []
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0
