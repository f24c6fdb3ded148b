"""Engine set-up: the checks on an EngineConfig against the model, then everything the
engine runs on (ranks, runners, the KV cache's plan and manager, scheduler, speculator),
built in the order each needs the last."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from forklift.checkpoint.source import ModelSource, resolve_model
from forklift.config import EngineConfig
from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.lora_slots import LoRASlotTable
from forklift.core.scheduler import Scheduler
from forklift.core.state_checkpoints import StateCheckpoints
from forklift.core.state_pool import StatePool
from forklift.engine.lora_registry import LoRARegistry
from forklift.engine.speculation import Speculator
from forklift.engine.weights_lifecycle import WeightsLifecycle
from forklift.model.model_config import ModelConfig
from forklift.model.model_source import iter_model_weights, load_model_config, quantization_plan
from forklift.model.mtp_layer import MultiTokenPredictor
from forklift.model.quantize import resolve_quantization
from forklift.model_drafters.draft_model import (
    DraftModelProposer,
    load_draft_runner,
    resolve_draft,
)
from forklift.model_drafters.mtp import (
    MtpProposer,
    check_mtp,
    load_mtp,
    mtp_block_bytes,
    mtp_weight_bytes,
)
from forklift.runner.decode_capture import capture_sizes
from forklift.runner.lora_store import LoRALimits
from forklift.runner.memory import KVCachePlan
from forklift.runner.model_runner import ModelRunner
from forklift.runner.tp_workers import (
    RankSpec,
    TensorParallelWorkers,
    cpu_threads_per_rank,
    start_tensor_parallel,
)
from forklift.spec_decode.proposer import BatchProposer, Proposer, make_proposer
from forklift.speculative_config import SpeculativeConfig
from forklift.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("forklift")

# Spare state slots a hybrid model plans for verifying drafts (each state is far larger than
# a KV block), whatever num_speculative_tokens asks.
MAX_SPARE_STATE_SLOTS = 8


@dataclass
class EngineParts:
    """What set-up built, for the engine to hold."""

    source: ModelSource
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    quantization: str
    tp_workers: TensorParallelWorkers | None
    runner: ModelRunner
    # Speculation's draft model or MTP layer: its K/V share the target's blocks and budget.
    draft_runner: ModelRunner | None
    mtp: MtpProposer | None
    kv_plan: KVCachePlan
    kv_manager: KVCacheManager
    weights: WeightsLifecycle
    state_pool: StatePool | None
    scheduler: Scheduler
    loras: LoRARegistry | None
    speculator: Speculator


def build_engine(config: EngineConfig) -> EngineParts:
    """Check `config` against the model, load the weights and size the KV cache; whatever
    can be refused is refused before any weight loads."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    source = resolve_model(config.model)
    model_config = load_model_config(source)
    spec = config.speculation
    # Speculation's drafter, checked against the model before any weight loads.
    method = spec.method if spec is not None else None
    draft = None
    if spec is not None and method == "draft_model":
        draft = resolve_draft(spec, config, source, model_config)
    if method == "mtp":
        check_mtp(source, model_config, config.tensor_parallel_size)
    lora = lora_limits(config, model_config)  # refused before any weight loads
    tokenizer = load_tokenizer(source)
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    kv_cache_dtype = config.resolve_kv_cache_dtype(device)
    max_model_len = resolve_max_model_len(config, model_config)
    quantization = resolve_quantization(config.quantization, config.dtype, source.format, device)
    tp_workers = start_tensor_parallel(
        config,
        model_config,
        device,
        RankSpec(
            model=str(source.path),
            device=str(device),
            dtype=dtype,
            max_model_len=max_model_len,
            block_size=config.block_size,
            sliding_window=model_config.uniform_window,
            num_threads=cpu_threads_per_rank(config),
            allow_cross_node=config.allow_cross_node_tensor_parallel,
            quantization=quantization,
            decode_backend=config.decode_backend,
            kv_cache_dtype=kv_cache_dtype,
        ),
    )
    runner = ModelRunner(
        model_config,
        partial(iter_model_weights, source, model_config),
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        block_size=config.block_size,
        sliding_window=model_config.uniform_window,
        # Captured decode runs on a single rank, and Llama-family layers, for now.
        enforce_eager=(
            config.resolve_enforce_eager(device)
            or tp_workers is not None
            or lora is not None  # a step's adapter rows are not captured
            or not model_config.has_llama_layers
        ),
        capture_sizes=capture_sizes(config.max_num_seqs, config.decode_capture_sizes),
        tp=tp_workers.group if tp_workers else None,
        quantization=quantization_plan(source, model_config, quantization),
        decode_backend=config.decode_backend,
        lora=lora,
        batch_invariant=config.batch_invariant,
        kv_cache_dtype=kv_cache_dtype,
    )
    draft_runner = None
    if draft is not None:
        draft_runner = load_draft_runner(
            draft, config, device=device, dtype=dtype, max_model_len=max_model_len
        )
    mtp_layer = None
    if method == "mtp":
        mtp_layer = load_mtp(
            source, model_config, device=device, dtype=dtype, max_model_len=max_model_len
        )
    kv_plan = plan_kv_cache(
        config, model_config, device, runner, draft_runner, mtp_layer, max_model_len
    )
    check_kv_fits(model_config, kv_plan, max_model_len)
    kv_manager = KVCacheManager(
        kv_plan.num_blocks,
        config.block_size,
        prefix_caching_enabled(config, model_config, kv_plan),
        kv_plan.windows,
    )
    if kv_manager.enable_prefix_caching and model_config.is_hybrid:
        first = kv_plan.num_state_slots + 1  # after the zero slot and the sequences' slots
        kv_manager.state_checkpoints = StateCheckpoints(
            range(first, first + kv_plan.num_checkpoint_slots), config.block_size
        )
    mtp = MtpProposer(mtp_layer, runner, kv_manager) if mtp_layer is not None else None
    weights = WeightsLifecycle(runner, draft_runner, mtp, kv_manager, kv_plan)
    weights.allocate_kv_caches()
    state_pool = StatePool(kv_plan.num_state_slots) if model_config.is_hybrid else None
    lora_slots = LoRASlotTable(config.max_loras) if lora is not None else None
    scheduler = Scheduler(
        kv_manager,
        max_running_sequences(config, model_config, kv_plan),
        config.resolve_max_num_batched_tokens(),
        state_pool,
        config.resolve_decode_step_prefill_tokens(),
        config.resolve_prefill_pace_steps(),
        lora_slots,
    )
    # The MTP layer's cache is indexed by the same block ids and would miss the copies.
    scheduler.copy_prompt_tails = mtp is None
    loras = None
    if runner.lora is not None and lora_slots is not None:
        loras = LoRARegistry(runner.lora, lora_slots, partial(_adapter_users, scheduler))
    speculator = build_speculator(
        config, runner, draft_runner, mtp, kv_manager, scheduler, state_pool
    )
    return EngineParts(
        source, model_config, tokenizer, device, dtype, max_model_len, quantization,
        tp_workers, runner, draft_runner, mtp, kv_plan, kv_manager, weights, state_pool,
        scheduler, loras, speculator,
    )  # fmt: skip


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    wanted = config.max_model_len
    if wanted is None:
        return limit
    if wanted > limit and not model_config.rope_scaling:
        raise ValueError(
            f"max_model_len ({wanted}) is larger than the model's context length ({limit})"
        )
    return wanted


def lora_limits(config: EngineConfig, model_config: ModelConfig) -> LoRALimits | None:
    if not config.enable_lora:
        return None
    if model_config.is_hybrid or model_config.attention_output_gate:
        raise ValueError(
            "enable_lora: LoRA adapters do not run the Qwen3.5 family (gated attention, "
            "linear-attention layers) yet"
        )
    if config.tensor_parallel_size > 1:
        raise ValueError("enable_lora: LoRA adapters do not run with tensor_parallel_size > 1 yet")
    return LoRALimits(config.max_loras, config.max_lora_rank, config.resolve_max_cpu_loras())


def planned_spare_slots(spec: SpeculativeConfig | None, model_config: ModelConfig) -> int:
    """State slots a hybrid model plans beyond max_num_seqs: a sequence verifying k
    drafts borrows k for the step (at most MAX_SPARE_STATE_SLOTS, shared by the running
    sequences), so speculation goes on at full batch."""
    if spec is None or not model_config.is_hybrid:
        return 0
    return min(spec.num_speculative_tokens, MAX_SPARE_STATE_SLOTS)


def plan_kv_cache(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    runner: ModelRunner,
    draft_runner: ModelRunner | None,
    mtp_layer: MultiTokenPredictor | None,
    max_model_len: int,
) -> KVCachePlan:
    """The KV cache's blocks for the budget, the drafter's weights and K/V taken out first
    (and a hybrid's state checkpoints, never below one sequence of `max_model_len`)."""
    extra_weight_bytes, extra_block_bytes = 0, 0
    if draft_runner is not None:
        extra_weight_bytes = draft_runner.weight_bytes
        extra_block_bytes = draft_runner.kv_block_bytes
    elif mtp_layer is not None:
        extra_weight_bytes = mtp_weight_bytes(mtp_layer, runner.backend.dense_step)
        extra_block_bytes = mtp_block_bytes(mtp_layer, config.block_size)
    return runner.plan_kv_cache(
        max_num_batched_tokens=config.resolve_max_num_batched_tokens(),
        max_num_seqs=config.max_num_seqs + planned_spare_slots(config.speculation, model_config),
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        num_blocks_override=config.num_gpu_blocks_override,
        memory_utilization=config.resolve_memory_utilization(device),
        extra_weight_bytes=extra_weight_bytes,
        extra_block_bytes=extra_block_bytes,
        state_checkpoints=config.enable_prefix_caching and model_config.is_hybrid,
        max_model_len=max_model_len,
    )


def check_kv_fits(model_config: ModelConfig, plan: KVCachePlan, max_model_len: int) -> None:
    if model_config.is_hybrid and plan.num_state_slots < 1:
        raise ValueError(
            f"the memory budget ({plan.source}) holds no linear-layer state slot of "
            f"{plan.state_bytes_per_slot} bytes. Raise kv_cache_memory_bytes or "
            "gpu_memory_utilization."
        )
    needed = plan.blocks_per_sequence(max_model_len)
    if plan.num_blocks - 1 < needed:
        raise ValueError(
            f"the KV cache holds {max(plan.num_blocks - 1, 0)} blocks "
            f"({plan.token_capacity} tokens; budget {plan.source}), but one request of "
            f"max_model_len={max_model_len} needs {needed} blocks of "
            f"{plan.block_size} tokens. Raise num_gpu_blocks_override, kv_cache_memory_bytes "
            f"or gpu_memory_utilization (whichever sized it), or lower max_model_len."
        )


def prefix_caching_enabled(
    config: EngineConfig, model_config: ModelConfig, plan: KVCachePlan
) -> bool:
    if not config.enable_prefix_caching or not model_config.is_hybrid:
        return config.enable_prefix_caching
    if plan.num_checkpoint_slots:
        return True
    # A hit resumes from a checkpoint of the linear layers' state where the prefix ends.
    logger.info(
        "prefix caching is off for this hybrid model: the memory budget (%s) holds no "
        "linear-layer state checkpoint of %.2f MiB",
        plan.source,
        plan.state_bytes_per_slot / 2**20,
    )
    return False


def max_running_sequences(
    config: EngineConfig, model_config: ModelConfig, plan: KVCachePlan
) -> int:
    """max_num_seqs, capped by the state slots a hybrid model's budget holds."""
    wanted = config.max_num_seqs
    if not model_config.is_hybrid:
        return wanted
    slots = plan.num_state_slots
    if slots < wanted:
        logger.warning(
            "max_num_seqs capped at %d (was %d): the memory budget holds %d linear-layer "
            "state slots of %.2f MiB",
            slots, wanted, slots, plan.state_bytes_per_slot / 2**20,
        )  # fmt: skip
    return min(slots, wanted)


def _adapter_users(scheduler: Scheduler, adapter_id: int) -> int:
    """How many unfinished requests run the adapter (one in use cannot be removed)."""
    return sum(r.lora_id == adapter_id for r in scheduler.requests.values())


def build_speculator(
    config: EngineConfig,
    runner: ModelRunner,
    draft_runner: ModelRunner | None,
    mtp: MtpProposer | None,
    kv_manager: KVCacheManager,
    scheduler: Scheduler,
    state_pool: StatePool | None,
) -> Speculator:
    """The speculator with the configured drafter and the drafter's cost per guess."""
    proposer: Proposer | BatchProposer | None = None
    # A draft forward's cost as a share of a target step: decode reads every weight.
    draft_cost = 0.0
    if draft_runner is not None:
        draft_cost = draft_runner.weight_bytes / runner.weight_bytes
        proposer = DraftModelProposer(
            draft_runner, kv_manager, config.resolve_max_num_batched_tokens()
        )
    elif mtp is not None:
        # The layer and the head it shares (about as large as the embedding).
        head = runner.model.embed_tokens.weight
        guess_bytes = mtp_weight_bytes(mtp.mtp) + head.numel() * head.element_size()
        draft_cost = guess_bytes / runner.weight_bytes
        proposer = mtp
    elif config.speculation is not None:
        proposer = make_proposer(config.speculation)
    return Speculator(config.speculation, proposer, draft_cost, mtp, runner, scheduler, state_pool)


def log_startup(parts: EngineParts, spec: SpeculativeConfig | None) -> None:
    """The model, the KV cache's size, adapters, states, weights and speculation, once."""
    plan, runner, model_config = parts.kv_plan, parts.runner, parts.model_config
    logger.info(
        "forklift: model %s (%s, %s layers) on %s in %s",
        parts.source.path,
        model_config.architecture,
        model_config.num_layers,
        parts.device,
        str(parts.dtype).removeprefix("torch."),
    )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens in %s (%.1f MiB; %s); max concurrency "
        "at max_model_len=%d: %.2fx",
        plan.num_blocks - 1,
        plan.block_size,
        plan.token_capacity,
        runner.kv_format.name,
        plan.num_blocks * plan.bytes_per_block / 2**20,
        plan.source,
        parts.max_model_len,
        plan.max_concurrency(parts.max_model_len),
    )
    lora = runner.lora
    if lora is not None:
        logger.info(
            "LoRA: %d adapter slots of rank up to %d (%.1f MiB, reserved before the KV "
            "cache), %d host copies",
            lora.limits.max_loras, lora.limits.max_lora_rank, lora.nbytes / 2**20,
            lora.limits.max_cpu_loras,
        )  # fmt: skip
    if plan.num_state_slots:
        logger.info(
            "linear-layer states: %d slots x %.2f MiB = %.1f MiB (one per running sequence, "
            "and spares for verifying drafts)",
            plan.num_state_slots,
            plan.state_bytes_per_slot / 2**20,
            plan.state_bytes / 2**20,
        )
    if plan.num_checkpoint_slots and parts.kv_manager.state_checkpoints is not None:
        logger.info(
            "linear-layer state checkpoints for prefix caching: %d slots x %.2f MiB = %.1f MiB",
            plan.num_checkpoint_slots,
            plan.state_bytes_per_slot / 2**20,
            plan.checkpoint_bytes / 2**20,
        )
    logger.info("%s", runner.quantization_report.summary())
    logger.info("weights resident: %.1f MiB", runner.weight_bytes / 2**20)
    if spec is not None:
        logger.info(
            "speculative decoding: %s, up to %d drafts per sequence and step%s",
            spec.method,
            spec.num_speculative_tokens,
            f" (off at {spec.disable_by_batch_size}+ running sequences)"
            if spec.disable_by_batch_size
            else "",
        )
    draft_cost = parts.speculator.draft_cost
    if draft_cost:
        drafter = parts.draft_runner.model_config if parts.draft_runner else None
        logger.info(
            "speculative decoding: the %s guesses at %.2f of a step's weight reads each",
            f"draft ({drafter.architecture}, {drafter.num_layers} layers)"
            if drafter else "MTP layer",
            draft_cost,
        )  # fmt: skip
