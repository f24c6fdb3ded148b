"""A compact GRPO loop colocated with the engine.

Each step: sample `group_size` completions for each of `prompts_per_step` problems, score
them with the task's exact checker, normalise rewards within each group (the advantage),
take one AdamW step on the clipped-ratio objective (plus an optional KL term to the initial
policy), and push the new weights into the engine with `update_weights`.

With `lora_rank`, the policy is a PEFT LoRA adapter on the frozen base (every projection):
only the adapter trains, rollouts run the engine's copy of it, and each step pushes the
adapter's tensors alone (`update_lora`), not the model's.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forklift.config import EngineConfig
from forklift.hf_reference import load_hf_model
from forklift.llm import LLM
from forklift.lora_request import LoRARequest
from forklift.model.lora import TARGET_OWNERS
from forklift.rl.rollouts import Rollout, forklift_rollouts, hf_rollouts
from forklift.rl.tasks import get_task

ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class GRPOConfig:
    model: str | None = None
    task: str = "arithmetic"
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 12
    temperature: float = 1.0
    learning_rate: float = 3e-5
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    rollout: str = "forklift"  # or "hf": the same loop with HF generate() rollouts
    micro_batch: int = 16
    seed: int = 0
    # The engine's share of memory; the rest is the trainer's.
    gpu_memory_utilization: float = 0.35
    max_model_len: int = 512
    # > 0: train a LoRA adapter of this rank (alpha = 2 x rank) instead of every weight.
    lora_rank: int = 0
    # What rollouts compute in, on either side (the policy trains in float32): "auto" is
    # the engine's rule, bfloat16 where the hardware has fast bf16, else float32. The
    # engine keeps the pushed weights dense in this dtype (no quantization), so it samples
    # the policy just trained.
    rollout_dtype: str = "auto"

    def validate(self) -> None:
        if self.rollout not in ("forklift", "hf"):
            raise ValueError(f"rollout must be 'forklift' or 'hf', got {self.rollout!r}")
        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: advantages compare samples of a group")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int):
            raise ValueError(f"lora_rank must be an integer, got {self.lora_rank!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full weights), got {self.lora_rank}")
        if self.lora_rank and self.rollout != "forklift":
            raise ValueError("lora_rank runs with forklift rollouts only")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ValueError(
                f"rollout_dtype must be one of {', '.join(ROLLOUT_DTYPES)}, "
                f"got {self.rollout_dtype!r}"
            )


@dataclass
class StepStats:
    step: int
    reward_mean: float
    generation_s: float
    training_s: float
    weight_sync_s: float
    step_s: float
    num_samples: int
    mean_completion_tokens: float
    loss: float
    # Mean |ratio - 1| at the update: how far trainer and sampler logprobs disagree.
    ratio_deviation: float

    def line(self) -> str:
        return (
            f"step {self.step:3d}  reward {self.reward_mean:.3f}  gen {self.generation_s:.2f}s  "
            f"train {self.training_s:.2f}s  sync {self.weight_sync_s:.2f}s  "
            f"step {self.step_s:.2f}s  |ratio-1| {self.ratio_deviation:.2e}"
        )


def group_advantages(rewards: list[float], groups: list[int]) -> list[float]:
    """(reward - group mean) / (group std + eps): zero for a group whose rewards are equal."""
    by_group: dict[int, list[float]] = {}
    for reward, group in zip(rewards, groups, strict=True):
        by_group.setdefault(group, []).append(reward)
    stats = {g: (statistics.fmean(r), statistics.pstdev(r)) for g, r in by_group.items()}
    return [(r - stats[g][0]) / (stats[g][1] + 1e-4) for r, g in zip(rewards, groups, strict=True)]


def completion_logprobs(
    model: torch.nn.Module, rollouts: list[Rollout], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, C] logprobs of each completion token under log_softmax(logits / T), and its mask."""
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    width, longest = max(lengths), max(len(r.completion_ids) for r in rollouts)
    ids = torch.zeros((len(rollouts), width), dtype=torch.long)
    attention = torch.zeros((len(rollouts), width), dtype=torch.long)
    for row, r in enumerate(rollouts):
        ids[row, : lengths[row]] = torch.tensor(r.prompt_ids + r.completion_ids)
        attention[row, : lengths[row]] = 1
    # Only completion positions need logits: the vocabulary projection is the costliest
    # matmul of the step, and prompts are most of each sequence.
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
    head = model.get_output_embeddings()
    mask = torch.zeros((len(rollouts), longest))
    rows = []
    for row, r in enumerate(rollouts):
        start, count = len(r.prompt_ids), len(r.completion_ids)
        # The token at position p is predicted by the hidden state at p - 1.
        step_logits = head(hidden[row, start - 1 : start - 1 + count]).float() / temperature
        chosen = torch.tensor(r.completion_ids)[:, None]
        rows.append(torch.log_softmax(step_logits, dim=-1).gather(1, chosen)[:, 0])
        mask[row, :count] = 1
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), mask


def _resolved_dtype(name: str) -> str:
    """The engine's "auto" settled here: a dtype asked for keeps the KV cache in it too (an
    "auto" engine on a CPU keeps bf16 K/V under an fp32 model), so the engine's rollouts
    compute as HF's do in the same dtype."""
    if name != "auto":
        return name
    config = EngineConfig(dtype="auto")
    return str(config.resolve_dtype(config.resolve_device())).removeprefix("torch.")


class GRPOTrainer:
    def __init__(self, config: GRPOConfig, llm: LLM | None = None) -> None:
        config.validate()
        self.config = config
        self.task = get_task(config.task)
        torch.manual_seed(config.seed)
        lora_settings = (
            {"enable_lora": True, "max_lora_rank": config.lora_rank} if config.lora_rank else {}
        )
        self.llm = llm or LLM(
            model=config.model,
            dtype=_resolved_dtype(config.rollout_dtype),
            quantization="none",
            max_model_len=config.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            **lora_settings,
        )
        engine = self.llm.llm_engine
        if engine.tokenizer is None:
            raise ValueError("GRPO needs a model with a tokenizer for its prompts and checker")
        self.tokenizer = engine.tokenizer
        # "auto" is the engine's own rule (bfloat16 where the hardware is fast at it); HF
        # rolls out in whatever the engine resolved, so both sides compute alike.
        self.rollout_dtype = engine.dtype
        self.policy = load_hf_model(engine.model_source, engine.model_config, torch.float32)
        # HF rollouts in another dtype sample a copy, refreshed after each update like the
        # engine's weights (and timed the same way).
        self.hf_sampler = (
            load_hf_model(engine.model_source, engine.model_config, self.rollout_dtype)
            if config.rollout == "hf" and self.rollout_dtype != torch.float32
            else None
        )
        self.lora: LoRARequest | None = None
        if config.lora_rank:
            self.policy, self.lora = self._attach_adapter(config.lora_rank)
        self.policy.train()
        self.reference = (
            copy.deepcopy(self.policy).eval().requires_grad_(False) if config.kl_coef else None
        )
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0)
        # Start the engine from exactly the trainer's weights.
        self._sync_weights()

    def _attach_adapter(self, rank: int) -> tuple[torch.nn.Module, LoRARequest]:
        """The policy as base + a fresh PEFT adapter (B = 0: the base's outputs), saved and
        registered with the engine under the name "grpo-policy"."""
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise ValueError("lora_rank needs the peft package: pip install peft") from exc
        adapter_config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_OWNERS), lora_dropout=0.0
        )
        policy = get_peft_model(self.policy, adapter_config)
        self._adapter_dir = tempfile.TemporaryDirectory(prefix="forklift-grpo-lora-")
        policy.save_pretrained(self._adapter_dir.name)
        lora = LoRARequest("grpo-policy", 1, self._adapter_dir.name)
        self.llm.add_lora(lora)
        return policy, lora

    def _encode(self, question: str) -> list[int]:
        return self.tokenizer.encode_chat([{"role": "user", "content": question}])

    def _sync_weights(self) -> float:
        start = time.perf_counter()
        if self.lora is not None:
            from peft import get_peft_model_state_dict

            tensors = get_peft_model_state_dict(self.policy)
            self.llm.update_lora(self.lora.lora_name, {k: v.detach() for k, v in tensors.items()})
        elif self.config.rollout == "forklift":
            self.llm.update_weights(
                (name, tensor.detach()) for name, tensor in self.policy.state_dict().items()
            )
        elif self.hf_sampler is not None:
            self.hf_sampler.load_state_dict(self.policy.state_dict())
        return time.perf_counter() - start

    def step(self, index: int) -> StepStats:
        cfg = self.config
        start = time.perf_counter()
        problems = self.task.problems(cfg.prompts_per_step, seed=cfg.seed * 100_003 + index)
        prompts = [self._encode(p.question) for p in problems]
        seed = cfg.seed * 1_000_003 + index * 1_009
        if cfg.rollout == "forklift":
            rollouts = forklift_rollouts(
                self.llm, prompts, cfg.group_size, cfg.temperature, cfg.max_tokens, seed, self.lora
            )
        else:
            self.policy.eval()
            rollouts = hf_rollouts(
                self.hf_sampler or self.policy, self.tokenizer, prompts, cfg.group_size,
                cfg.temperature, cfg.max_tokens, seed,
            )  # fmt: skip
        generation_s = time.perf_counter() - start
        for r in rollouts:
            r.reward = self.task.reward(problems[r.group], r.text)
        rewards = [r.reward for r in rollouts]
        advantages = group_advantages(rewards, [r.group for r in rollouts])

        train_start = time.perf_counter()
        loss, deviation = self._update(rollouts, advantages)
        training_s = time.perf_counter() - train_start
        sync_s = self._sync_weights()
        return StepStats(
            step=index,
            reward_mean=statistics.fmean(rewards),
            generation_s=generation_s,
            training_s=training_s,
            weight_sync_s=sync_s,
            step_s=time.perf_counter() - start,
            num_samples=len(rollouts),
            mean_completion_tokens=statistics.fmean(len(r.completion_ids) for r in rollouts),
            loss=loss,
            ratio_deviation=deviation,
        )

    def _update(self, rollouts: list[Rollout], advantages: list[float]) -> tuple[float, float]:
        """One optimizer step on the token-mean clipped objective, in micro-batches."""
        cfg = self.config
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(r.completion_ids) for r in rollouts)
        loss_sum, deviation_sum = 0.0, 0.0
        for begin in range(0, len(rollouts), cfg.micro_batch):
            chunk = rollouts[begin : begin + cfg.micro_batch]
            adv = torch.tensor(advantages[begin : begin + cfg.micro_batch])[:, None]
            new, mask = completion_logprobs(self.policy, chunk, cfg.temperature)
            old = torch.nn.utils.rnn.pad_sequence(
                [torch.tensor(r.logprobs) for r in chunk], batch_first=True
            )
            ratio = torch.exp(new - old)
            clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
            per_token = -torch.minimum(ratio * adv, clipped * adv)
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = completion_logprobs(self.reference, chunk, cfg.temperature)
                log_ratio = ref - new  # k3 estimator of KL(policy || reference)
                per_token = per_token + cfg.kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
            loss = (per_token * mask).sum() / total_tokens
            loss.backward()
            loss_sum += loss.item()
            deviation_sum += ((ratio.detach() - 1).abs() * mask).sum().item()
        torch.nn.utils.clip_grad_norm_(
            [p for p in self.policy.parameters() if p.requires_grad], 1.0
        )
        self.optimizer.step()
        return loss_sum, deviation_sum / total_tokens

    def run(self, on_step: Callable[[StepStats], None] | None = None) -> list[StepStats]:
        history = []
        for index in range(self.config.steps):
            stats = self.step(index)
            history.append(stats)
            if on_step is not None:
                on_step(stats)
        return history
