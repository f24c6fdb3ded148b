"""`forklift bench ...`: benchmarks that write markdown, JSON and a chart to --out-dir.

Each benchmark is one row of `BENCHMARKS`; its flags and run function are in `commands`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from forklift.bench import commands
from forklift.bench.report import require_matplotlib


@dataclass(frozen=True)
class Benchmark:
    """One `forklift bench NAME` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # It draws a PNG with matplotlib (the `bench` extra).
    chart: bool = True

    def main(self, args: argparse.Namespace) -> int:
        # Checked up front: a missing extra should not cost a long run.
        if self.chart:
            require_matplotlib()
        return self.run(args)


BENCHMARKS = (
    Benchmark(
        "memory",
        "KV memory wasted by contiguous reservation vs paged blocks",
        commands.add_memory_args,
        commands.memory_command,
    ),
    Benchmark(
        "throughput",
        "offline output tok/s: forklift vs HF generate() static batches",
        commands.add_throughput_args,
        commands.throughput_command,
    ),
    Benchmark(
        "serve",
        "streaming load sweep against an OpenAI-compatible server",
        commands.add_serve_args,
        commands.serve_command,
    ),
    Benchmark(
        "prefix",
        "prefix caching on vs off; n-sample groups vs independent requests",
        commands.add_prefix_args,
        commands.prefix_command,
    ),
    Benchmark(
        "grpo",
        "GRPO step time: forklift vs HF rollouts",
        commands.add_grpo_bench_args,
        commands.grpo_command,
    ),
    Benchmark(
        "decode",
        "decode step time by weight form and batch size vs read bandwidth",
        commands.add_decode_args,
        commands.decode_command,
    ),
    Benchmark(
        "lora",
        "decode step and serving cost of LoRA adapters, mixed in one batch",
        commands.add_lora_args,
        commands.lora_command,
    ),
    Benchmark(
        "profile",
        "where a decode step's time goes",
        commands.add_profile_args,
        commands.profile_command,
    ),
    Benchmark(
        "scale",
        "one engine vs TP=2 vs DP=2 serving, and TP all-reduce arithmetic",
        commands.add_scale_args,
        commands.scale_command,
    ),
    Benchmark(
        "startup",
        "forklift serve time to ready, cold and warm",
        commands.add_startup_args,
        commands.startup_command,
        chart=False,
    ),
    Benchmark(
        "soak",
        "many mixed requests and dropped streams: no errors, no leaked blocks",
        commands.add_soak_args,
        commands.soak_command,
    ),
    Benchmark(
        "hybrid",
        "a Qwen3.5 hybrid vs its all-attention twin: prefill and decode",
        commands.add_hybrid_args,
        commands.hybrid_command,
        chart=False,
    ),
    Benchmark(
        "structured",
        "decode under a JSON schema vs free text, batch 1 and 8",
        commands.add_structured_args,
        commands.structured_command,
        chart=False,
    ),
    Benchmark(
        "spec",
        "speculative decoding vs none, and vs llama-server's n-gram modes",
        commands.add_spec_args,
        commands.spec_command,
    ),
)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (reports go to --out-dir)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for benchmark in BENCHMARKS:
        parser = bench_sub.add_parser(benchmark.name, help=benchmark.help)
        benchmark.add_arguments(parser)
        parser.add_argument("--out-dir", default="benchmarks")
        parser.set_defaults(func=benchmark.main)
