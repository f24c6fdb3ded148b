"""LLMEngine: add requests, step, stream outputs, abort."""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch

from forklift.checkpoint.gguf_file import release_pages
from forklift.checkpoint.source import resolve_model
from forklift.config import EngineConfig
from forklift.core.input_processor import InputProcessor, ProcessedPrompt, PromptType
from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.lora_slots import LoRASlotTable
from forklift.core.request import FinishReason, Request
from forklift.core.scheduler import Scheduler
from forklift.core.scheduler_output import SchedulerOutput
from forklift.core.state_pool import StatePool
from forklift.engine.lora_registry import LoRAInfo, LoRARegistry
from forklift.engine.output_processor import (
    OutputProcessor,
    OutputSequence,
    ParentRequest,
    mark_first_token,
)
from forklift.engine.speculation import Speculator
from forklift.engine.stats import EngineStats, PrefixCacheStats, StepRecord
from forklift.engine.weights_lifecycle import WeightsLifecycle
from forklift.lora_request import LoRARequest
from forklift.model.model_source import iter_model_weights, load_model_config, quantization_plan
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
from forklift.outputs import PrefillChunk, RequestMetrics, RequestOutput
from forklift.runner.decode_capture import capture_sizes
from forklift.runner.lora_store import LoRALimits
from forklift.runner.model_runner import ModelRunner
from forklift.runner.tp_workers import RankSpec, cpu_threads_per_rank, start_tensor_parallel
from forklift.sampling.sampler import SamplerOutput
from forklift.sampling_params import SamplingParams
from forklift.spec_decode.proposer import (
    BatchProposer,
    Proposer,
    make_proposer,
)
from forklift.spec_decode.stats import SpecDecodeStats
from forklift.structured.grammar import GrammarCompiler
from forklift.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("forklift")

# Distinct seeds for the n sequences of one seeded request; sequence 0 keeps the user's seed.
_SEQUENCE_SEED_STRIDE = 0x9E3779B97F4A7C1


def sample_seed(request_seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n > 1` samples."""
    return (request_seed + index * _SEQUENCE_SEED_STRIDE) % (1 << 62)


def _sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n sequences: its own when n is 1, else "<id>#<index>"."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


# Step records kept for inspection (tests, debugging); older ones are dropped.
_STEP_LOG_SIZE = 4096
# Spare state slots a hybrid model plans for verifying drafts (each state is far larger than
# a KV block), whatever num_speculative_tokens asks.
MAX_SPARE_STATE_SLOTS = 8


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        source = resolve_model(config.model)
        self.model_source = source
        self.model_config = load_model_config(source)
        self.speculation = config.speculation
        # Speculation's drafter, checked against the model before any weight loads.
        method = self.speculation.method if self.speculation is not None else None
        draft = None
        if self.speculation is not None and method == "draft_model":
            draft = resolve_draft(self.speculation, config, source, self.model_config)
        if method == "mtp":
            check_mtp(source, self.model_config, config.tensor_parallel_size)
        lora_limits = self._lora_limits()  # refused before any weight loads
        self.tokenizer: Tokenizer | None = load_tokenizer(source)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.quantization = resolve_quantization(
            config.quantization, config.dtype, source.format, self.device
        )
        self._tp_workers = start_tensor_parallel(
            config,
            self.model_config,
            self.device,
            RankSpec(
                model=str(source.path),
                device=str(self.device),
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                sliding_window=self.model_config.uniform_window,
                num_threads=cpu_threads_per_rank(config),
                allow_cross_node=config.allow_cross_node_tensor_parallel,
                quantization=self.quantization,
                decode_backend=config.decode_backend,
                kv_cache_dtype=config.kv_cache_dtype,
            ),
        )
        self.runner = ModelRunner(
            self.model_config,
            partial(iter_model_weights, source, self.model_config),
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            sliding_window=self.model_config.uniform_window,
            # Captured decode runs on a single rank, and Llama-family layers, for now.
            enforce_eager=(
                config.resolve_enforce_eager(self.device)
                or self._tp_workers is not None
                or lora_limits is not None  # a step's adapter rows are not captured
                or not self.model_config.has_llama_layers
            ),
            capture_sizes=capture_sizes(config.max_num_seqs, config.decode_capture_sizes),
            tp=self._tp_workers.group if self._tp_workers else None,
            quantization=quantization_plan(source, self.model_config, self.quantization),
            decode_backend=config.decode_backend,
            lora=lora_limits,
            batch_invariant=config.batch_invariant,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        # Speculation's draft model or MTP layer: its K/V share the target's blocks and budget.
        self.draft_runner: ModelRunner | None = None
        self.mtp: MtpProposer | None = None
        if draft is not None:
            self.draft_runner = load_draft_runner(
                draft, config, device=self.device, dtype=self.dtype,
                max_model_len=self.max_model_len,
            )  # fmt: skip
        mtp_layer = None
        if method == "mtp":
            mtp_layer = load_mtp(
                source, self.model_config, device=self.device, dtype=self.dtype,
                max_model_len=self.max_model_len,
            )  # fmt: skip
        extra_weight_bytes, extra_block_bytes = 0, 0
        if self.draft_runner is not None:
            extra_weight_bytes = self.draft_runner.weight_bytes
            extra_block_bytes = self.draft_runner.kv_block_bytes
        elif mtp_layer is not None:
            extra_weight_bytes = mtp_weight_bytes(mtp_layer)
            extra_block_bytes = mtp_block_bytes(mtp_layer, config.block_size)
        self.kv_plan = self.runner.plan_kv_cache(
            max_num_batched_tokens=config.resolve_max_num_batched_tokens(),
            max_num_seqs=config.max_num_seqs + self._planned_spare_slots(),
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            num_blocks_override=config.num_gpu_blocks_override,
            memory_utilization=config.resolve_memory_utilization(self.device),
            extra_weight_bytes=extra_weight_bytes,
            extra_block_bytes=extra_block_bytes,
        )
        self._check_kv_fits()
        self.kv_manager = KVCacheManager(
            self.kv_plan.num_blocks,
            config.block_size,
            self._prefix_caching_enabled(),
            self.kv_plan.windows,
        )
        if mtp_layer is not None:
            self.mtp = MtpProposer(mtp_layer, self.runner, self.kv_manager)
        self.weights = WeightsLifecycle(
            self.runner, self.draft_runner, self.mtp, self.kv_manager, self.kv_plan
        )
        self.weights.allocate_kv_caches()
        self.state_pool = (
            StatePool(self.kv_plan.num_state_slots) if self.model_config.is_hybrid else None
        )
        lora_slots = LoRASlotTable(config.max_loras) if lora_limits is not None else None
        self.scheduler = Scheduler(
            self.kv_manager,
            self._max_running_sequences(),
            config.resolve_max_num_batched_tokens(),
            self.state_pool,
            config.resolve_decode_step_prefill_tokens(),
            config.resolve_prefill_pace_steps(),
            lora_slots,
        )
        # The MTP layer's cache is indexed by the same block ids and would miss the copies.
        self.scheduler.copy_prompt_tails = self.mtp is None
        self.loras: LoRARegistry | None = None
        if self.runner.lora is not None and lora_slots is not None:
            self.loras = LoRARegistry(self.runner.lora, lora_slots, self._lora_users)
        proposer: Proposer | BatchProposer | None = None
        # A draft forward's cost as a share of a target step: decode reads every weight.
        draft_cost = 0.0
        if self.draft_runner is not None:
            draft_cost = self.draft_runner.weight_bytes / self.runner.weight_bytes
            proposer = DraftModelProposer(
                self.draft_runner, self.kv_manager, config.resolve_max_num_batched_tokens()
            )
        elif self.mtp is not None:
            # The layer and the head it shares (about as large as the embedding).
            head = self.runner.model.embed_tokens.weight
            guess_bytes = mtp_weight_bytes(self.mtp.mtp) + head.numel() * head.element_size()
            draft_cost = guess_bytes / self.runner.weight_bytes
            proposer = self.mtp
        elif self.speculation is not None:
            proposer = make_proposer(self.speculation)
        self.speculator = Speculator(
            self.speculation, proposer, draft_cost, self.mtp, self.runner, self.scheduler,
            self.state_pool,
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.grammars, self.model_config.vocab_size, self.max_model_len
        )
        self._parents: dict[str, ParentRequest] = {}
        self._sequences: dict[str, tuple[ParentRequest, OutputSequence]] = {}
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self.step_log: deque[StepRecord] = deque(maxlen=_STEP_LOG_SIZE)
        self._num_steps = 0
        self._log_startup(source.path)
        if source.format == "gguf":
            release_pages(source.gguf_reader())  # the model holds its weights now

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- setup ---------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit and not self.model_config.rope_scaling:
            raise ValueError(
                f"max_model_len ({wanted}) is larger than the model's context length ({limit})"
            )
        return wanted

    def _lora_limits(self) -> LoRALimits | None:
        config = self.config
        if not config.enable_lora:
            return None
        if self.model_config.is_hybrid or self.model_config.attention_output_gate:
            raise ValueError(
                "enable_lora: LoRA adapters do not run the Qwen3.5 family (gated attention, "
                "linear-attention layers) yet"
            )
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora: LoRA adapters do not run with tensor_parallel_size > 1 yet"
            )
        return LoRALimits(config.max_loras, config.max_lora_rank, config.resolve_max_cpu_loras())

    def _prefix_caching_enabled(self) -> bool:
        if not self.config.enable_prefix_caching or not self.model_config.is_hybrid:
            return self.config.enable_prefix_caching
        # A hit would have to restore the linear layers' state where the cached prefix ends,
        # i.e. a state snapshot kept per cached block: far larger than the block itself.
        plan = self.kv_plan
        logger.info(
            "prefix caching is off for this hybrid model: restoring a cached prefix needs a "
            "linear-layer state snapshot per block, %.2f MiB each, against %.2f MiB of KV per "
            "block",
            plan.state_bytes_per_slot / 2**20,
            plan.bytes_per_block / 2**20,
        )
        return False

    def _max_running_sequences(self) -> int:
        """max_num_seqs, capped by the state slots a hybrid model's budget holds."""
        wanted = self.config.max_num_seqs
        if not self.model_config.is_hybrid:
            return wanted
        slots = self.kv_plan.num_state_slots
        if slots < wanted:
            logger.warning(
                "max_num_seqs capped at %d (was %d): the memory budget holds %d linear-layer "
                "state slots of %.2f MiB",
                slots, wanted, slots, self.kv_plan.state_bytes_per_slot / 2**20,
            )  # fmt: skip
        return min(slots, wanted)

    def _planned_spare_slots(self) -> int:
        """State slots a hybrid model plans beyond max_num_seqs: a sequence verifying k
        drafts borrows k for the step (at most MAX_SPARE_STATE_SLOTS, shared by the running
        sequences), so speculation goes on at full batch."""
        if self.speculation is None or not self.model_config.is_hybrid:
            return 0
        return min(self.speculation.num_speculative_tokens, MAX_SPARE_STATE_SLOTS)

    def _check_kv_fits(self) -> None:
        plan = self.kv_plan
        if self.model_config.is_hybrid and plan.num_state_slots < 1:
            raise ValueError(
                f"the memory budget ({plan.source}) holds no linear-layer state slot of "
                f"{plan.state_bytes_per_slot} bytes. Raise kv_cache_memory_bytes or "
                "gpu_memory_utilization."
            )
        needed = plan.blocks_per_sequence(self.max_model_len)
        if plan.num_blocks - 1 < needed:
            raise ValueError(
                f"the KV cache holds {max(plan.num_blocks - 1, 0)} blocks "
                f"({plan.token_capacity} tokens; budget {plan.source}), but one request of "
                f"max_model_len={self.max_model_len} needs {needed} blocks of "
                f"{plan.block_size} tokens. Raise num_gpu_blocks_override, kv_cache_memory_bytes "
                f"or gpu_memory_utilization (whichever sized it), or lower max_model_len."
            )

    def _log_startup(self, path: object) -> None:
        plan = self.kv_plan
        logger.info(
            "forklift: model %s (%s, %s layers) on %s in %s",
            path,
            self.model_config.architecture,
            self.model_config.num_layers,
            self.device,
            str(self.dtype).removeprefix("torch."),
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens in %s (%.1f MiB; %s); max concurrency "
            "at max_model_len=%d: %.2fx",
            plan.num_blocks - 1,
            plan.block_size,
            plan.token_capacity,
            self.runner.kv_format.name,
            plan.num_blocks * plan.bytes_per_block / 2**20,
            plan.source,
            self.max_model_len,
            plan.max_concurrency(self.max_model_len),
        )
        lora = self.runner.lora
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
        logger.info("%s", self.runner.quantization_report.summary())
        logger.info("weights resident: %.1f MiB", self.runner.weight_bytes / 2**20)
        spec = self.speculation
        if spec is not None:
            logger.info(
                "speculative decoding: %s, up to %d drafts per sequence and step%s",
                spec.method,
                spec.num_speculative_tokens,
                f" (off at {spec.disable_by_batch_size}+ running sequences)"
                if spec.disable_by_batch_size
                else "",
            )
        if self.speculator.draft_cost:
            drafter = self.draft_runner.model_config if self.draft_runner else None
            logger.info(
                "speculative decoding: the %s guesses at %.2f of a step's weight reads each",
                f"draft ({drafter.architecture}, {drafter.num_layers} layers)"
                if drafter else "MTP layer",
                self.speculator.draft_cost,
            )  # fmt: skip

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; invalid input raises ValueError and leaves the engine untouched."""
        self.weights.check_awake()  # before the prompt's checks: being asleep outranks a bad prompt
        processed = self.input_processor.process(prompt, params or SamplingParams())
        return self.add_processed(request_id, processed, arrival_time, lora_request)

    def add_processed(
        self,
        request_id: str | None,
        processed: ProcessedPrompt,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt `input_processor` already checked (e.g. on a server worker thread);
        only what depends on the engine's state now (asleep, a taken id) is checked here."""
        self.weights.check_awake()
        params, prompt_ids = processed.params, processed.prompt_token_ids
        lora_id = self._lora_id(lora_request)
        key: tuple[object, ...] = (self.weight_version, processed.cache_salt)
        if lora_id and self.loras is not None:
            key += self.loras.cache_key_part(lora_id)
        cache_key = repr(key).encode()
        if request_id is None:
            request_id = self._fresh_id(params.n)
        seq_ids = _sequence_ids(request_id, params.n)
        taken = self._taken(request_id, seq_ids)
        if taken == request_id:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if taken is not None:  # e.g. "x#0" beside another request "x" with n > 1
            raise ValueError(f"request_id {request_id!r} is already in use (as {taken!r})")
        queued = time.time()
        metrics = RequestMetrics(arrival_time=arrival_time or queued, queued_time=queued)
        parent = ParentRequest(request_id, processed.prompt, prompt_ids, metrics)
        parent.queued_at_step = self._num_steps
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]  # the first token has nothing before it
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        eos = (
            self.tokenizer.eos_token_ids
            if self.tokenizer
            else frozenset(self.model_config.eos_token_ids)
        )
        constraint = params.structured_outputs
        grammars = self.grammars.matchers(constraint, params.n) if constraint else None
        for index, seq_id in enumerate(seq_ids):
            request = Request(
                request_id=seq_id,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                seed=sample_seed(base_seed, index),
                max_tokens=max_tokens,
                eos_token_ids=frozenset(eos),
                arrival_time=metrics.arrival_time,
                cache_key=cache_key,
                lora_id=lora_id,
                grammar=grammars[index] if grammars else None,
            )
            sequence = OutputSequence(
                index, request, self.output_processor.new_detokenizer(request)
            )
            parent.sequences.append(sequence)
            self._sequences[seq_id] = (parent, sequence)
        self._parents[request_id] = parent
        leader, *followers = [sequence.request for sequence in parent.sequences]
        if len(prompt_ids) > self.config.block_size:  # else there is no full block to share
            leader.followers = followers
            for follower in followers:
                follower.prefix_leader = leader
        for sequence in parent.sequences:
            self.scheduler.add_request(sequence.request)
        return request_id

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The adapter's id (registering it on first sight), 0 for the base model."""
        if lora_request is None:
            return 0
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if self.loras is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r}: this engine was started without "
                "enable_lora"
            )
        return self.loras.add(lora_request)

    def _lora_users(self, adapter_id: int) -> int:
        return sum(r.lora_id == adapter_id for r in self.scheduler.requests.values())

    def _taken(self, request_id: str, seq_ids: list[str]) -> str | None:
        """The id already in use (the request's own, or one of its sequences'), or None."""
        if request_id in self._parents:
            return request_id
        return next((seq_id for seq_id in seq_ids if seq_id in self._sequences), None)

    def _fresh_id(self, n: int) -> str:
        while True:
            self._next_id += 1
            candidate = str(self._next_id)
            if self._taken(candidate, _sequence_ids(candidate, n)) is None:
                return candidate

    def abort_request(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests wherever they are; their blocks are freed at once. Unknown ids are
        ignored (the request may have just finished)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs = []
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for sequence in parent.sequences:
                self.scheduler.finish(sequence.request, FinishReason.ABORT)
                self._sequences.pop(sequence.request.request_id, None)
                self.speculator.forget(sequence.request)
            parent.metrics.finished_time = time.time()
            outputs.append(self._output(parent))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that advanced or finished."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.time()
        started = time.perf_counter()
        for request_id in sched.preempted:
            self._sequences[request_id][1].request.queued_time = now
        for item in sched.scheduled:
            parent, _ = self._sequences[item.request_id]
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now
                parent.metrics.steps_waited = self._num_steps - parent.queued_at_step
        try:
            result = self.runner.execute(
                sched.scheduled, sched.state_copies, sched.lora_loads, sched.block_copies
            )
        except RuntimeError as exc:
            if self._tp_workers is not None:
                self._tp_workers.raise_if_dead(exc)  # a rank died: say which, and why
            raise
        self.speculator.record_step(sched.scheduled, self._siblings)
        out = result.sampler_output
        rows_of: list[list[int]] = [[] for _ in sched.scheduled]
        for row, item in enumerate(result.sampled_items):
            rows_of[item].append(row)
        sampled: list[int | list[int] | None] = [None] * len(sched.scheduled)
        if out is not None:
            for item, rows in enumerate(rows_of):
                if rows:
                    sampled[item] = self.speculator.accepted_tokens(
                        sched.scheduled[item], rows, out
                    )
        touched: dict[str, ParentRequest] = {}
        emitted = 0

        def on_token(item: int, position: int) -> bool:
            nonlocal emitted
            assert out is not None
            emitted += 1
            parent, sequence = self._sequences[sched.scheduled[item].request_id]
            stopped = self._process_sample(sequence, out, rows_of[item][position])
            mark_first_token(parent.metrics)
            touched[parent.request_id] = parent
            return stopped

        self.scheduler.update(sched, sampled, on_token)
        for item, scores in result.prompt_scores:
            chunk = sched.scheduled[item]
            parent, _ = self._sequences[chunk.request_id]
            top = chunk.prompt_logprobs or 0
            self.output_processor.record_prompt_logprobs(parent, chunk.start + 1, scores, top)
        if self.speculator.proposer is not None:
            self.speculator.propose()
        self._record_step(sched, now, time.perf_counter() - started, emitted)
        return [self._emit(parent) for parent in touched.values()]

    def _siblings(self, sequence_id: str) -> list[str]:
        """The ids of every sample of the request `sequence_id` belongs to."""
        parent, _ = self._sequences[sequence_id]
        return [sibling.request.request_id for sibling in parent.sequences]

    def _record_step(
        self, sched: SchedulerOutput, start: float, duration: float, sampled: int
    ) -> None:
        """The step in the step log, and on the timeline of each request that computed
        prompt tokens in it (once per request: the samples of n > 1 share their prompt)."""
        self._num_steps += 1
        # Every scheduled sequence is still registered: finished ones leave in _emit, later.
        parents: dict[str, ParentRequest] = {}
        prompt_tokens: dict[str, int] = {}
        for chunk in sched.scheduled:
            parent = self._sequences[chunk.request_id][0]
            parents[parent.request_id] = parent
            if chunk.num_prompt_tokens:
                before = prompt_tokens.get(parent.request_id, 0)
                prompt_tokens[parent.request_id] = max(before, chunk.num_prompt_tokens)
        self.step_log.append(
            StepRecord(
                self._num_steps,
                start,
                duration,
                tuple(parents),
                sched.num_batched_tokens,
                sampled,
                len(sched.preempted),
                sum(s.num_prompt_tokens for s in sched.scheduled),
            )
        )
        # The chunk ends on the wall clock its first token was stamped by (time.time() and
        # perf_counter drift apart by a tenth of a millisecond over a step at times).
        end = max(time.time(), start)
        for request_id, tokens in prompt_tokens.items():
            step = PrefillChunk(start, end, tokens, sched.num_batched_tokens)
            parents[request_id].metrics.prefill_chunks.append(step)

    def _process_sample(self, sequence: OutputSequence, out: SamplerOutput, row: int) -> bool:
        """Record one appended token; True when a stop string or a complete grammar ended
        the sequence on it."""
        request = sequence.request
        top = None
        if out.top_ids is not None:
            count = request.sampling_params.logprobs or 0
            top = list(zip(out.top_ids[row][:count], out.top_logprobs[row][:count], strict=True))
        logprob = (
            out.logprobs[row]
            if (out.logprobs is not None and request.sampling_params.logprobs is not None)
            else None
        )
        rank = out.ranks[row] if out.ranks is not None else None
        token_id = out.token_ids[row]
        grammar_done = request.grammar is not None and self._advance_grammar(request, token_id)
        hit_stop = self.output_processor.process_token(sequence, token_id, logprob, rank, top)
        if grammar_done and not hit_stop and sequence.detokenizer is not None:
            sequence.detokenizer.finalize()
        if hit_stop or grammar_done:
            stop = sequence.detokenizer.stop_reason if sequence.detokenizer else None
            if request.is_finished:
                request.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(request, FinishReason.STOP)
            request.stop_reason = stop
        return hit_stop or grammar_done

    @staticmethod
    def _advance_grammar(request: Request, token_id: int) -> bool:
        """Feed the sampled token to the sequence's grammar; True when the grammar is
        complete (only end-of-sequence could follow), which ends the sequence now."""
        grammar = request.grammar
        assert grammar is not None
        if request.is_finished:
            return False  # stopped on EOS, a stop id or the length: nothing more to sample
        if not grammar.accept(token_id):
            # The sampler never draws outside the mask (a grammar outranks bans that would
            # empty its row), so this is a bug guard: end the sequence and say why.
            logger.warning(
                "request %s: token %d breaks its grammar (%s); finishing it",
                request.request_id, token_id, grammar.error,
            )  # fmt: skip
            return True
        return grammar.is_finished

    def _emit(self, parent: ParentRequest) -> RequestOutput:
        if parent.finished:
            parent.metrics.finished_time = time.time()
            self._parents.pop(parent.request_id, None)
            for sequence in parent.sequences:
                self._sequences.pop(sequence.request.request_id, None)
                self.speculator.forget(sequence.request)
        return self._output(parent)

    def _output(self, parent: ParentRequest) -> RequestOutput:
        output = parent.to_output()
        output.weight_version = self.weight_version
        return output

    # ---- weights and memory, for RL loops --------------------------------------------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], finalize: bool = True
    ) -> int:
        """Load HF-named tensors (any order, any subset) into the model.

        With `finalize=False` they are only checked and staged, so an update can arrive in
        pieces; the call with `finalize=True` swaps everything staged in at once, bumps
        `weight_version` and retires the prefix cache. A bad name, shape or dtype raises
        ValueError, drops the pending update and leaves the old weights whole. Requests
        already running continue with the new weights. Returns the number of tensors staged
        (or applied, when finalizing).
        """
        return self.weights.update_weights(named_tensors, finalize)

    @property
    def weight_version(self) -> int:
        """Bumped by every weight update; outputs carry the version that produced them."""
        return self.weights.weight_version

    @property
    def sleep_level(self) -> int:
        """0 = awake; 1 = KV cache freed; 2 = KV cache and weights freed."""
        return self.weights.sleep_level

    # ---- LoRA adapters -------------------------------------------------------------------
    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("this engine was started without enable_lora")
        return self.loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read, check and register an adapter ahead of its requests."""
        self._lora_registry().add(lora_request)
        return True

    def remove_lora(self, adapter: str | int) -> LoRARequest:
        """Forget an adapter (by name or id) that no unfinished request uses."""
        return self._lora_registry().remove(adapter)

    def list_loras(self) -> list[LoRAInfo]:
        return [] if self.loras is None else self.loras.infos()

    def update_lora(self, adapter: str | int, tensors: dict[str, torch.Tensor]) -> int:
        """Replace an adapter's weights (PEFT-named tensors, e.g. from
        `peft.get_peft_model_state_dict`) between steps; other adapters' requests go on.
        Returns the adapter's new version; its older prefix-cache entries are not reused."""
        return self._lora_registry().update(adapter, tensors)

    @property
    def num_staged_weights(self) -> int:
        return self.runner.num_staged_weights

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and also the weights (level 2) for a trainer's use.

        Only between requests: in-flight requests must finish or be aborted first."""
        self.weights.sleep(level, in_flight=self.has_unfinished_requests())

    def wake_up(self) -> None:
        """Reallocate what `sleep` freed; weights dropped at level 2 are reloaded from the
        model source (push newer ones with `update_weights` afterwards)."""
        self.weights.wake_up()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op for a single rank)."""
        if self._tp_workers is not None:
            try:
                self.runner.shutdown()
            except RuntimeError as exc:  # a rank already died: stop the others anyway
                logger.warning("tensor parallel: shutdown broadcast failed (%s)", exc)
            self._tp_workers.join()
            self._tp_workers = None

    # ---- prefix cache --------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block so none is reused; returns how many were dropped."""
        return self.kv_manager.reset_prefix_cache()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        kv = self.kv_manager
        return PrefixCacheStats(
            kv.enable_prefix_caching, kv.num_query_tokens, kv.num_hit_tokens,
            kv.pool.num_cached_blocks, kv.pool.num_evictions,
        )  # fmt: skip

    # ---- introspection ------------------------------------------------------------------
    def stats(self, with_running_slots: bool = False) -> EngineStats:
        """A snapshot of the scheduler's and KV cache's counters. `with_running_slots` adds
        every running request's reserved and used slots (a walk over the running batch)."""
        scheduler, kv = self.scheduler, self.kv_manager
        slots: tuple[tuple[int, int], ...] = ()
        if with_running_slots:
            slots = tuple(
                (len(kv.block_table(r.request_id)) * kv.block_size, r.num_computed_tokens)
                for r in scheduler.running
            )
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_preemptions=scheduler.num_preemptions,
            kv_usage=kv.usage(),
            num_free_blocks=kv.num_free_blocks,
            num_usable_blocks=self.num_usable_blocks,
            prefix_cache=self.prefix_cache_stats(),
            running_slots=slots,
            spec_decode=self.spec_stats.snapshot() if self.speculation else None,
        )

    @property
    def proposer(self) -> Proposer | BatchProposer | None:
        """Speculation's drafter; tests swap in an oracle."""
        return self.speculator.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | BatchProposer | None) -> None:
        self.speculator.proposer = proposer

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.speculator.stats

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.kv_plan.num_blocks - 1
