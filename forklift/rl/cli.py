"""`forklift rl grpo` and `forklift bench grpo`: the GRPO loop from the command line."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forklift.rl.grpo import GRPOConfig

# Settings small enough for a test (well under 3 minutes here).
QUICK = {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_tokens": 4}


def add_grpo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--prompts-per-step", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None, help="samples per prompt (n)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--kl-coef", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a tiny run (a few steps)")


def config_from_args(args: argparse.Namespace, **extra: object) -> GRPOConfig:
    from forklift.rl.grpo import GRPOConfig

    values = dict(QUICK) if args.quick else {}
    for name in ("model", "task", "steps", "prompts_per_step", "group_size", "max_tokens",
                 "temperature", "learning_rate", "kl_coef", "seed"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    config = GRPOConfig(**values, **extra)
    config.validate()
    return config


def add_rl_parser(sub: argparse._SubParsersAction) -> None:
    rl = sub.add_parser("rl", help="reinforcement learning with forklift rollouts")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True)
    grpo = rl_sub.add_parser("grpo", help="train the model with GRPO on a verifiable task")
    add_grpo_args(grpo)
    grpo.add_argument("--rollout", choices=("forklift", "hf"), default="forklift")
    grpo.set_defaults(func=_cmd_grpo)


def _cmd_grpo(args: argparse.Namespace) -> int:
    from forklift.rl.grpo import GRPOTrainer

    trainer = GRPOTrainer(config_from_args(args, rollout=args.rollout))
    trainer.run(lambda stats: print(stats.line(), flush=True))
    return 0


def add_bench_grpo_parser(bench_sub: argparse._SubParsersAction) -> None:
    parser = bench_sub.add_parser("grpo", help="GRPO step time: forklift vs HF rollouts")
    add_grpo_args(parser)
    parser.add_argument("--hf-steps", type=int, default=None, help="steps with HF rollouts")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.set_defaults(func=_cmd_bench_grpo)


def _cmd_bench_grpo(args: argparse.Namespace) -> int:
    from forklift.bench.grpo import render_markdown, run_grpo_bench, write_report
    from forklift.bench.report import announce

    config = config_from_args(args)
    hf_steps = args.hf_steps if args.hf_steps is not None else (1 if args.quick else 5)
    if hf_steps < 1:
        raise ValueError(f"--hf-steps must be >= 1, got {hf_steps}")
    report = run_grpo_bench(config, hf_steps, log=lambda line: print(line, flush=True))
    report["command"] = "forklift bench grpo" + _flags(args)
    announce(write_report(report, Path(args.out_dir)), render_markdown(report))
    return 0


def _flags(args: argparse.Namespace) -> str:
    parts = ["--quick"] if args.quick else []
    for name in ("model", "steps", "prompts_per_step", "group_size", "max_tokens",
                 "temperature", "learning_rate", "kl_coef", "seed", "hf_steps"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    if args.task != "arithmetic":
        parts += ["--task", args.task]
    return (" " + shlex.join(parts)) if parts else ""
