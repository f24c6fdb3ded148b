"""`forklift bench grpo`: GRPO with forklift rollouts vs HF `generate()` rollouts.

The forklift run trains for `steps` steps (the reward curve); the HF run repeats the first
`hf_steps` steps from the same initial weights and seeds. Reported side by side: average
generation time per step and total step time, and their ratios.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forklift.bench.report import subplots, write_report_files
from forklift.rl.grpo import GRPOConfig, GRPOTrainer, StepStats

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def run_grpo_bench(config: GRPOConfig, hf_steps: int, log=print) -> dict[str, Any]:  # noqa: ANN001
    fk_trainer = GRPOTrainer(replace(config, rollout="forklift"))
    forklift_steps = fk_trainer.run(lambda s: log("forklift " + s.line()))
    llm = fk_trainer.llm
    rollout_dtype = str(fk_trainer.rollout_dtype).removeprefix("torch.")
    del fk_trainer
    hf_trainer = GRPOTrainer(replace(config, rollout="hf", steps=hf_steps), llm=llm)
    hf_history = hf_trainer.run(lambda s: log("hf       " + s.line()))

    def mean(history: list[StepStats], field: str, count: int) -> float:
        return statistics.fmean(getattr(s, field) for s in history[:count])

    compared = min(hf_steps, len(forklift_steps))
    summary = {
        side: {
            field: mean(history, field, compared)
            for field in ("generation_s", "training_s", "weight_sync_s", "step_s", "reward_mean")
        }
        for side, history in (("forklift", forklift_steps), ("hf", hf_history))
    }
    return {
        "benchmark": "grpo",
        "config": asdict(config),
        "rollout_dtype": rollout_dtype,
        "hf_steps": hf_steps,
        "compared_steps": compared,
        "forklift": [asdict(s) for s in forklift_steps],
        "hf": [asdict(s) for s in hf_history],
        "summary": summary,
        "generation_speedup": summary["hf"]["generation_s"] / summary["forklift"]["generation_s"],
        "step_speedup": summary["hf"]["step_s"] / summary["forklift"]["step_s"],
        "reward_first_quarter": _quarter_mean(forklift_steps, first=True),
        "reward_last_quarter": _quarter_mean(forklift_steps, first=False),
    }


def _quarter_mean(history: list[StepStats], first: bool) -> float:
    size = max(len(history) // 4, 1)
    part = history[:size] if first else history[-size:]
    return statistics.fmean(s.reward_mean for s in part)


def render_markdown(report: dict[str, Any]) -> str:
    cfg, summary = report["config"], report["summary"]
    lines = [
        "# GRPO: forklift rollouts vs HF `generate()` rollouts",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Task `{cfg['task']}`, {cfg['prompts_per_step']} prompts x {cfg['group_size']} samples "
        f"per step, up to {cfg['max_tokens']} tokens, temperature {cfg['temperature']}, "
        f"AdamW lr {cfg['learning_rate']}, clip {cfg['clip_eps']}, KL {cfg['kl_coef']}. "
        "The policy trains in PyTorch (HF transformers model, fp32); after every optimizer "
        "step its weights go into the engine with `update_weights`. Rollouts on both sides "
        f"compute in {report.get('rollout_dtype', 'float32')}: the engine keeps the pushed "
        "weights dense in it, HF generates from a copy refreshed after each update.",
        "",
        f"## Time per step (mean of the first {report['compared_steps']} steps, both sides)",
        "",
        "| rollouts | generation (s) | training (s) | weight sync (s) | step (s) | reward |",
        "|---|---|---|---|---|---|",
    ]
    for side, label in (("hf", "HF generate()"), ("forklift", "forklift")):
        s = summary[side]
        lines.append(
            f"| {label} | {s['generation_s']:.2f} | {s['training_s']:.2f} | "
            f"{s['weight_sync_s']:.2f} | {s['step_s']:.2f} | {s['reward_mean']:.3f} |"
        )
    lines += [
        "",
        f"forklift vs HF: **{report['generation_speedup']:.2f}x** faster generation, "
        f"**{report['step_speedup']:.2f}x** faster steps.",
        "",
        f"## Reward over {len(report['forklift'])} steps with forklift rollouts",
        "",
        f"Mean reward of the first quarter of steps {report['reward_first_quarter']:.3f}, "
        f"of the last quarter {report['reward_last_quarter']:.3f}.",
        "",
        "| step | reward | generation (s) | training (s) | sync (s) | mean |ratio - 1| |",
        "|---|---|---|---|---|---|",
    ]
    for s in report["forklift"]:
        lines.append(
            f"| {s['step']} | {s['reward_mean']:.3f} | {s['generation_s']:.2f} | "
            f"{s['training_s']:.2f} | {s['weight_sync_s']:.2f} | {s['ratio_deviation']:.1e} |"
        )
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "grpo", render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    fig, (left, right) = subplots(1, 2, figsize=(11, 4))
    steps = [s["step"] for s in report["forklift"]]
    rewards = [s["reward_mean"] for s in report["forklift"]]
    left.plot(steps, rewards, "o-", color="#2a7ab0", label="forklift rollouts")
    left.plot([s["step"] for s in report["hf"]], [s["reward_mean"] for s in report["hf"]],
              "s--", color="#999999", label="HF rollouts")  # fmt: skip
    left.set_xlabel("step")
    left.set_ylabel("mean reward")
    left.set_title("Reward")
    left.legend()
    summary = report["summary"]
    parts = ("generation_s", "training_s", "weight_sync_s")
    bottom = [0.0, 0.0]
    for part, color in zip(parts, ("#2a7ab0", "#d95f02", "#7570b3"), strict=True):
        values = [summary["hf"][part], summary["forklift"][part]]
        right.bar(["HF generate()", "forklift"], values, bottom=bottom, color=color,
                  label=part.removesuffix("_s").replace("_", " "))  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("seconds per step")
    right.set_title(f"Step time ({report['step_speedup']:.2f}x)")
    right.legend()
    return fig
