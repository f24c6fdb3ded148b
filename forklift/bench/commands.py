"""What each `forklift bench NAME` command parses and runs (`cli.BENCHMARKS` lists them).

Each run function imports its benchmark only when it runs: most pull in torch or an HTTP
client, which `forklift --help` and `forklift serve` should not pay for. Each records the
command line that reproduces its run in the report (never an API key, and a binary by its
program name only). `--out-dir` is added to every command by the table's loop.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forklift.config import DECODE_BACKENDS, QUANTIZATION_METHODS
from forklift.rl.cli import add_grpo_args, config_from_args


def announce(paths: list[Path], markdown: str) -> None:
    """Tell the user where a report went, then show it."""
    for path in paths:
        print(f"wrote {path}")
    print(markdown)


def positive_ints(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated command-line list of positive integers, e.g. "1,8,32"."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise ValueError(f"{flag} must be positive integers, got {text!r}")
    return values


def _command(name: str, quick: bool = False) -> list[str]:
    return ["forklift", "bench", name] + (["--quick"] if quick else [])


def _given(args: argparse.Namespace, *names: str) -> list[str]:
    """`--flag value` for each of these options that was given, in this order."""
    parts: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    return parts


def _publish(
    report: dict[str, Any],
    command: list[str],
    out_dir: str,
    write_report: Callable[[dict[str, Any], Path], list[Path]],
    render_markdown: Callable[[dict[str, Any]], str],
) -> None:
    """Record the command line that reproduces the run, write the report files, show it."""
    report["command"] = shlex.join(command)
    announce(write_report(report, Path(out_dir)), render_markdown(report))


def _set(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options that were given, as settings overrides."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


# ---- memory -------------------------------------------------------------------------------


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a shorter measured run")
    parser.add_argument("--model", default=None, help="HF model dir or GGUF file (default model)")
    parser.add_argument(
        "--budget-gib", type=float, default=None, help="at-scale KV budget (default: 16 requests)"
    )


def memory_command(args: argparse.Namespace) -> int:
    from forklift.bench.memory.run import run_memory_bench, summary, write_report

    if args.budget_gib is not None and args.budget_gib <= 0:
        raise ValueError(f"--budget-gib must be > 0, got {args.budget_gib}")
    command = ["forklift", "bench", "memory", "--out-dir", args.out_dir]
    command += (["--quick"] if args.quick else []) + _given(args, "model", "budget_gib")
    report = run_memory_bench(shlex.join(command), args.quick, args.model, args.budget_gib)
    write_report(report, Path(args.out_dir))
    print(summary(report))
    return 0


# ---- throughput ---------------------------------------------------------------------------


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument(
        "--output-lengths", default=None, help="comma-separated, cycled (default 32,64,128,512)"
    )
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")


def throughput_command(args: argparse.Namespace) -> int:
    from forklift.bench.throughput import (
        ThroughputSettings,
        render_markdown,
        run_throughput,
        write_report,
    )

    overrides: dict[str, Any] = {"model": args.model, "dtype": args.dtype}
    overrides |= _set(args, "num_requests", "hf_batch_size", "max_model_len")
    if args.output_lengths is not None:
        overrides["output_lengths"] = positive_ints(args.output_lengths, "--output-lengths")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    settings = (ThroughputSettings.quick if args.quick else ThroughputSettings)(**overrides)
    report = run_throughput(settings)
    command = shlex.join(_command("throughput", args.quick))
    paths = write_report(report, Path(args.out_dir), command)
    announce(paths, render_markdown({**report, "command": command}))
    return 0


# ---- serve --------------------------------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--peer-command",
        default=None,
        help="shell command that starts the --peer-url server after forklift's sweep (stopped "
        "after its own), so neither server holds memory while the other is measured",
    )
    parser.add_argument("--peer-threads", type=int, default=None, help="llama-server -t / -tb")
    parser.add_argument("--name", default="serve", help="report file name stem")
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")


def serve_command(args: argparse.Namespace) -> int:
    from forklift.bench.serve import ServeSettings, render_markdown, run_serve_bench, write_report

    overrides: dict[str, Any] = {
        "base_url": args.base_url,
        "model": args.model,
        "served_model": args.served_model,
        "endpoint": args.endpoint,
        "api_key": args.api_key,
        "server_args": args.server_arg,
        "peer_url": args.peer_url,
        "peer_command": args.peer_command,
        "llama_server": args.llama_server,
        "peer_threads": args.peer_threads,
    }
    overrides |= _set(
        args, "input_tokens", "output_tokens", "min_requests", "requests_per_concurrency"
    )
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
    command = _command("serve", args.quick)
    command += _given(args, "base_url", "model", "served_model", "input_tokens", "output_tokens",
                      "concurrency", "min_requests", "requests_per_concurrency", "peer_url",
                      "peer_command", "peer_threads")  # fmt: skip
    command += ["--endpoint", args.endpoint] if args.endpoint != "completions" else []
    # The binary's path is this machine's; the report names the program only.
    command += ["--llama-server", "llama-server"] if args.llama_server else []
    command += [f"--server-arg={server_arg}" for server_arg in args.server_arg]
    return shlex.join(command)


# ---- prefix -------------------------------------------------------------------------------


def add_prefix_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")


def prefix_command(args: argparse.Namespace) -> int:
    from forklift.bench.prefix import (
        PrefixSettings,
        render_markdown,
        run_prefix_bench,
        write_report,
    )

    overrides = {"model": args.model, "dtype": args.dtype}
    settings = (PrefixSettings.quick if args.quick else PrefixSettings)(**overrides)
    report = run_prefix_bench(settings)
    command = _command("prefix", args.quick) + _given(args, "model")
    command += ["--dtype", args.dtype] if args.dtype != "auto" else []
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- grpo ---------------------------------------------------------------------------------


def add_grpo_bench_args(parser: argparse.ArgumentParser) -> None:
    add_grpo_args(parser)
    parser.add_argument("--hf-steps", type=int, default=None, help="steps with HF rollouts")


def grpo_command(args: argparse.Namespace) -> int:
    from forklift.bench.grpo import render_markdown, run_grpo_bench, write_report

    config = config_from_args(args)
    hf_steps = args.hf_steps if args.hf_steps is not None else (1 if args.quick else 5)
    if hf_steps < 1:
        raise ValueError(f"--hf-steps must be >= 1, got {hf_steps}")
    report = run_grpo_bench(config, hf_steps, log=lambda line: print(line, flush=True))
    command = _command("grpo", args.quick)
    command += _given(args, "model", "steps", "prompts_per_step", "group_size", "max_tokens",
                      "temperature", "learning_rate", "kl_coef", "seed", "hf_steps",
                      "rollout_dtype")  # fmt: skip
    command += ["--task", args.task] if args.task != "arithmetic" else []
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- decode -------------------------------------------------------------------------------


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--forms",
        default=None,
        help="comma-separated: fp32, bf16, int8, int4 (native step), int4-avx2, int4-torch, "
        "int4-captured, int4-torch-attention, int4-kv8 and int4-avx2-kv8 (an int8 KV cache)",
    )
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    parser.add_argument(
        "--llama-bench", default=None, help="llama.cpp's llama-bench binary: run it side by side"
    )
    parser.add_argument(
        "--peer-rounds",
        type=int,
        default=None,
        help="rounds alternating forklift's single stream and llama-bench (default 3)",
    )
    parser.add_argument("--quick", action="store_true", help="a small run (under 3 minutes)")


def decode_command(args: argparse.Namespace) -> int:
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
    if args.peer_rounds is not None:
        overrides["peer_rounds"] = positive_ints(str(args.peer_rounds), "--peer-rounds")[0]
    report = run_decode_bench((DecodeSettings.quick if args.quick else DecodeSettings)(**overrides))
    command = _command("decode", args.quick)
    command += _given(args, "model", "forms", "batch_sizes", "context", "peer_rounds")
    # The binary's path is this machine's; the report names the program only.
    command += ["--llama-bench", "llama-bench"] if args.llama_bench else []
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- lora ---------------------------------------------------------------------------------


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--ranks", default=None, help="comma-separated adapter ranks")
    parser.add_argument("--quick", action="store_true", help="a small run (under 2 minutes)")


def lora_command(args: argparse.Namespace) -> int:
    from forklift.bench.lora import LoRABenchSettings, render_markdown, run_lora_bench, write_report

    overrides: dict[str, Any] = {"model": args.model}
    if args.batch_sizes is not None:
        overrides["batch_sizes"] = positive_ints(args.batch_sizes, "--batch-sizes")
    if args.ranks is not None:
        overrides["ranks"] = positive_ints(args.ranks, "--ranks")
    settings = (LoRABenchSettings.quick if args.quick else LoRABenchSettings)(**overrides)
    report = run_lora_bench(settings)
    command = _command("lora", args.quick) + _given(args, "model", "batch_sizes", "ranks")
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- profile ------------------------------------------------------------------------------


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="profiled decode steps per size")
    parser.add_argument("--context", type=int, default=564, help="prompt tokens per request")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_METHODS)
    parser.add_argument("--decode-backend", default="auto", choices=DECODE_BACKENDS)


def profile_command(args: argparse.Namespace) -> int:
    from forklift.bench.step_profile import render_markdown, run_profile_bench, write_report

    sizes = positive_ints(args.batch_sizes, "--batch-sizes")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    context = positive_ints(str(args.context), "--context")[0]
    report = run_profile_bench(
        args.model, args.dtype, sizes, args.steps, context, args.quantization, args.decode_backend
    )
    command = _command("profile") + ["--batch-sizes", args.batch_sizes]
    command += ["--steps", str(args.steps), "--context", str(context)]
    command += ["--quantization", args.quantization] if args.quantization != "auto" else []
    command += ["--decode-backend", args.decode_backend] if args.decode_backend != "auto" else []
    command += _given(args, "model")
    command += ["--dtype", args.dtype] if args.dtype != "auto" else []
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- scale --------------------------------------------------------------------------------


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--output-tokens", type=int, default=64)


def scale_command(args: argparse.Namespace) -> int:
    from forklift.bench.scale import ScaleSettings, render_markdown, run_scale_bench, write_report

    settings = ScaleSettings(
        model=args.model,
        concurrencies=positive_ints(args.concurrency, "--concurrency"),
        output_tokens=args.output_tokens,
    )
    report = run_scale_bench(settings)
    command = _command("scale") + ["--concurrency", args.concurrency]
    command += ["--output-tokens", str(args.output_tokens)] + _given(args, "model")
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- startup ------------------------------------------------------------------------------


def add_startup_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)


def startup_command(args: argparse.Namespace) -> int:
    from forklift.bench.startup import render_markdown, run_startup_bench, write_report

    report = run_startup_bench(args.model)
    command = _command("startup") + _given(args, "model")
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- soak ---------------------------------------------------------------------------------

_SOAK_OPTIONS = ("num_requests", "concurrency", "disconnect_share")


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument(
        "--disconnect-share", type=float, default=None, help="share of streams dropped"
    )
    parser.add_argument("--quick", action="store_true", help="a small run (under a minute)")


def soak_command(args: argparse.Namespace) -> int:
    from forklift.bench.soak import SoakSettings, render_markdown, run_soak, write_report

    overrides: dict[str, Any] = {"model": args.model, **_set(args, *_SOAK_OPTIONS)}
    report = run_soak((SoakSettings.quick if args.quick else SoakSettings)(**overrides))
    command = _command("soak", args.quick) + _given(args, "model", *_SOAK_OPTIONS)
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0 if report["errors"] == 0 and report["final_kv_usage"] == 0 else 1


# ---- hybrid -------------------------------------------------------------------------------


def add_hybrid_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default=None, help="comma-separated: float32,bfloat16")
    parser.add_argument("--contexts", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="toy models, seconds")


def hybrid_command(args: argparse.Namespace) -> int:
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
    command = _command("hybrid", args.quick) + _given(args, "dtypes", "contexts", "batch_sizes")
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- structured ---------------------------------------------------------------------------


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="a few tokens, seconds")


def structured_command(args: argparse.Namespace) -> int:
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
    command = _command("structured", args.quick) + _given(args, "model", "batch_sizes")
    _publish(report, command, args.out_dir, write_report, render_markdown)
    return 0


# ---- spec ---------------------------------------------------------------------------------
def add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument(
        "--llama-server", default=None, help="llama.cpp's llama-server: its n-gram modes too"
    )
    parser.add_argument("--threads", type=int, default=None, help="llama-server -t / -tb")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--grounded-concurrency", default=None, help="comma-separated levels")
    parser.add_argument("--chat-concurrency", default=None, help="comma-separated levels")
    parser.add_argument(
        "--method",
        action="append",
        default=None,
        help="a forklift --speculative-config JSON, or none (repeatable; default: none, "
        "ngram and suffix)",
    )
    parser.add_argument("--quick", action="store_true", help="a few tokens, about a minute")


def spec_command(args: argparse.Namespace) -> int:
    from forklift.bench.spec import SpecSettings, render_markdown, run_spec_bench, write_report

    overrides: dict[str, Any] = {"model": args.model, "llama_server": args.llama_server}
    overrides |= _set(args, "threads", "max_tokens")
    for flag in ("grounded_concurrency", "chat_concurrency"):
        if getattr(args, flag) is not None:
            overrides[flag] = positive_ints(getattr(args, flag), f"--{flag.replace('_', '-')}")
    if args.method:
        overrides["forklift_methods"] = tuple(args.method)
    settings = (SpecSettings.quick if args.quick else SpecSettings)(**overrides)
    report = run_spec_bench(settings)
    command = _command("spec", args.quick)
    command += _given(args, "model", "threads", "max_tokens", "grounded_concurrency",
                      "chat_concurrency")  # fmt: skip
    command += ["--llama-server", "llama-server"] if args.llama_server else []
    command += [f"--method={method}" for method in args.method or ()]
    _publish(report, command, args.out_dir, write_report, render_markdown)
    failed = sum(len(point["errors"]) for point in report["points"])
    return 1 if failed else 0
