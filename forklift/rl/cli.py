"""`forklift rl grpo`: the GRPO loop from the command line. Its flags and config are shared
with `forklift bench grpo`, which builds on them (rl imports no benchmark)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forklift.rl.grpo import GRPOConfig

# Settings small enough for a test (well under 3 minutes here).
QUICK: Mapping[str, int] = MappingProxyType(
    {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_tokens": 4}
)


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
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="train a LoRA adapter of this rank instead of every weight (needs peft)",
    )
    parser.add_argument(
        "--rollout-dtype",
        default=None,
        help="what rollouts compute in: auto (bfloat16 where fast, else float32), "
        "float32, bfloat16, float16",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run (a few steps)")


def config_from_args(args: argparse.Namespace, **extra: object) -> GRPOConfig:
    from forklift.rl.grpo import GRPOConfig

    values = dict(QUICK) if args.quick else {}
    for name in ("model", "task", "steps", "prompts_per_step", "group_size", "max_tokens",
                 "temperature", "learning_rate", "kl_coef", "seed", "lora_rank",
                 "rollout_dtype"):  # fmt: skip
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
