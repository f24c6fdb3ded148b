"""The GRPO loop: advantages, the task checker, and `forklift bench grpo --quick` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from forklift.cli import main
from forklift.cpu import cpu_has_fast_bf16
from forklift.rl.grpo import GRPOConfig, group_advantages
from forklift.rl.tasks import ArithmeticTask, Problem, get_task


def test_group_advantages_normalise_within_groups():
    advantages = group_advantages([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0, 1, 1])
    assert advantages[:4] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-3)
    assert advantages[4:] == [0.0, 0.0]  # a group that agrees teaches nothing


def test_arithmetic_task_checks_exactly():
    task = ArithmeticTask()
    problems = task.problems(50, seed=1)
    assert problems == task.problems(50, seed=1)
    for problem in problems:
        a, op, b = problem.question.removeprefix("What is ").removesuffix("?").split()
        assert op == "+" and int(problem.answer) == int(a) + int(b)
    seven = Problem("What is 3 + 4?", "7")
    assert task.reward(seven, " 7") == 1.0
    assert task.reward(seven, "3 + 4 = 7.") == 1.0
    assert task.reward(seven, "3 + 4 = 17") == 0.0
    assert task.reward(seven, "The sum of 3 and") == 0.0
    assert task.reward(seven, "seven") == 0.0
    with pytest.raises(ValueError, match="unknown task"):
        get_task("chess")
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1).validate()
    with pytest.raises(ValueError, match="rollout_dtype"):
        GRPOConfig(rollout_dtype="int8").validate()


@pytest.mark.slow
@pytest.mark.parametrize(("rollout_dtype", "ratio_bound"), [("float32", 1e-3), ("bfloat16", 0.15)])
def test_quick_grpo_bench(tmp_path, rollout_dtype, ratio_bound):
    """float32 rollouts are the trainer's numbers exactly; bfloat16 ones (both sides) stay
    within a few percent of them."""
    args = ["bench", "grpo", "--quick", "--rollout-dtype", rollout_dtype]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "grpo.json").read_text())
    assert (tmp_path / "grpo.md").read_text().startswith("# GRPO")
    assert (tmp_path / "grpo.png").stat().st_size > 0
    config = report["config"]
    assert len(report["forklift"]) == config["steps"] and len(report["hf"]) == report["hf_steps"]
    samples = config["prompts_per_step"] * config["group_size"]
    for step in report["forklift"] + report["hf"]:
        assert step["num_samples"] == samples
        assert 0.0 <= step["reward_mean"] <= 1.0
        assert 1 <= step["mean_completion_tokens"] <= config["max_tokens"]
        assert step["step_s"] >= step["generation_s"] + step["training_s"]
    # The engine's logprobs are the trainer's at every step: the ratio is 1 before each
    # update, which also shows each update reached the engine.
    assert config["rollout_dtype"] == report["rollout_dtype"] == rollout_dtype
    assert all(step["ratio_deviation"] < ratio_bound for step in report["forklift"])
    assert report["hf"][0]["ratio_deviation"] < ratio_bound
    summary = report["summary"]
    assert report["generation_speedup"] == pytest.approx(
        summary["hf"]["generation_s"] / summary["forklift"]["generation_s"]
    )
    assert report["step_speedup"] == pytest.approx(
        summary["hf"]["step_s"] / summary["forklift"]["step_s"]
    )


def test_auto_rollouts_keep_the_kv_cache_in_the_dtype_they_compute_in():
    """An engine left to "auto" keeps bf16 K/V on a CPU even where it computes in fp32; the
    trainer settles the dtype first, so its rollouts' cache is in the rollout dtype, as the
    HF side's is."""
    from forklift.rl.grpo import GRPOTrainer

    trainer = GRPOTrainer(GRPOConfig(rollout_dtype="auto", gpu_memory_utilization=0.1))
    runner = trainer.llm.llm_engine.runner
    assert trainer.rollout_dtype == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert runner.dtype == runner.kv_format.storage == trainer.rollout_dtype


@pytest.mark.slow
def test_grpo_with_a_lora_adapter_keeps_engine_and_trainer_in_step():
    """The policy is a PEFT adapter: each step pushes only its tensors (`update_lora`), and
    the engine's rollout logprobs under the pushed adapter are HF + PEFT's (ratio 1 before
    every update, including after the first update made the adapter non-zero)."""
    from forklift.rl.grpo import GRPOTrainer, completion_logprobs
    from forklift.rl.rollouts import forklift_rollouts

    config = GRPOConfig(steps=1, prompts_per_step=2, group_size=4, max_tokens=4, lora_rank=4,
                        learning_rate=1e-3, rollout_dtype="float32")  # fmt: skip
    trainer = GRPOTrainer(config)
    history = trainer.run()
    assert all(step.ratio_deviation < 1e-3 for step in history)
    (info,) = trainer.llm.list_loras()
    assert (info.name, info.version) == ("grpo-policy", 2)  # the first sync, then one per step
    # A trainer's update that moves the adapter well off the base (a few quick steps may have
    # all-equal rewards, hence no gradient): the engine's rollouts follow it.
    with torch.no_grad():
        for name, param in trainer.policy.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)
    trainer._sync_weights()
    prompts = [trainer._encode("What is 2 + 3?")]
    rollouts = forklift_rollouts(trainer.llm, prompts, 4, 1.0, 6, seed=5, lora_request=trainer.lora)
    base_rollouts = forklift_rollouts(trainer.llm, prompts, 4, 1.0, 6, seed=5)
    with torch.no_grad():
        new, mask = completion_logprobs(trainer.policy, rollouts, 1.0)
    engine = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(r.logprobs) for r in rollouts], batch_first=True
    )
    assert ((new - engine).abs() * mask).max() < 1e-3
    assert [r.logprobs for r in rollouts] != [r.logprobs for r in base_rollouts]
    base = [p for n, p in trainer.policy.named_parameters() if "lora_" not in n]
    assert not any(p.requires_grad for p in base)
    with pytest.raises(ValueError, match="forklift rollouts only"):
        GRPOConfig(lora_rank=4, rollout="hf").validate()
