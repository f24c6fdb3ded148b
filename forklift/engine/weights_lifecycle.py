"""WeightsLifecycle: an RL loop's hold on the model's memory between requests."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from forklift.core.kv_cache_manager import KVCacheManager
from forklift.model_drafters.mtp import MtpProposer
from forklift.runner.memory import KVCachePlan
from forklift.runner.model_runner import ModelRunner


class WeightsLifecycle:
    """New weights pushed in (each update bumps `weight_version`, which the prefix cache
    keys on), and the KV cache and weights freed for a trainer (`sleep`) and brought back
    (`wake_up`). Owns the caches' allocation for the target, the draft model and the MTP
    layer, which share the plan's blocks."""

    def __init__(
        self,
        runner: ModelRunner,
        draft_runner: ModelRunner | None,
        mtp: MtpProposer | None,
        kv_manager: KVCacheManager,
        kv_plan: KVCachePlan,
    ) -> None:
        self.runner = runner
        self.draft_runner = draft_runner
        self.mtp = mtp
        self.kv_manager = kv_manager
        self.kv_plan = kv_plan
        # Bumped by every weight update; the prefix cache keys on it.
        self.weight_version = 0
        # 0 = awake; 1 = KV cache freed; 2 = KV cache and weights freed.
        self.sleep_level = 0

    @property
    def runners(self) -> list[ModelRunner]:
        """The target's runner and, when speculating with one, the draft model's."""
        return [self.runner] + ([self.draft_runner] if self.draft_runner is not None else [])

    def allocate_kv_caches(self) -> None:
        plan = self.kv_plan
        # A hybrid's checkpoint slots follow its sequences' slots in the same tensors.
        self.runner.allocate_kv_cache(
            plan.num_blocks, plan.num_state_slots + plan.num_checkpoint_slots
        )
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(self.kv_plan.num_blocks)
        if self.mtp is not None:
            self.mtp.allocate_cache(self.kv_plan.num_blocks)

    def check_awake(self) -> None:
        if self.sleep_level:
            raise ValueError("the engine is asleep: call wake_up() before generating")

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], finalize: bool = True
    ) -> int:
        """See LLMEngine.update_weights."""
        if self.sleep_level >= 2:
            raise ValueError("the weights were dropped by sleep(level=2): call wake_up() first")
        staged = self.runner.stage_weights(list(named_tensors))
        if not finalize:
            return staged
        applied = self.runner.commit_weights()
        self.weight_version += 1
        self.kv_manager.reset_prefix_cache()
        return applied

    def sleep(self, level: int, in_flight: bool) -> None:
        """Free the KV cache (level 1) and also the weights (level 2); refused while
        requests are `in_flight`."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if in_flight:
            raise ValueError("cannot sleep with requests in flight: finish or abort them first")
        self.kv_manager.reset_prefix_cache()
        for runner in self.runners:
            runner.free_kv_cache()
            if level == 2:
                runner.free_weights()
        if self.mtp is not None:
            self.mtp.free_cache()
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """See LLMEngine.wake_up."""
        if self.sleep_level == 0:
            return
        if self.sleep_level == 2:
            for runner in self.runners:
                runner.reload_weights()
            self.weight_version += 1
        self.allocate_kv_caches()
        self.sleep_level = 0
