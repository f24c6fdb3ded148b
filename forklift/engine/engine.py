"""LLMEngine: add requests, step, stream outputs, abort."""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from forklift.checkpoint.gguf_file import release_pages
from forklift.config import EngineConfig
from forklift.core.input_processor import InputProcessor, ProcessedPrompt, PromptType
from forklift.core.request import FinishReason, Request
from forklift.core.scheduler_output import SchedulerOutput
from forklift.engine.lora_registry import LoRAInfo, LoRARegistry
from forklift.engine.output_processor import (
    OutputProcessor,
    OutputSequence,
    ParentRequest,
    mark_first_token,
)
from forklift.engine.request_table import RequestTable, sequence_ids
from forklift.engine.setup import build_engine, log_startup
from forklift.engine.stats import EngineStats, PrefixCacheStats, StepRecord
from forklift.lora_request import LoRARequest
from forklift.outputs import PrefillChunk, RequestMetrics, RequestOutput
from forklift.sampling.sampler import SamplerOutput
from forklift.sampling_params import SamplingParams
from forklift.spec_decode.proposer import BatchProposer, Proposer
from forklift.spec_decode.stats import SpecDecodeStats
from forklift.structured.grammar import GrammarCompiler
from forklift.tokenizer import Tokenizer

logger = logging.getLogger("forklift")

# Distinct seeds for the n sequences of one seeded request; sequence 0 keeps the user's seed.
_SEQUENCE_SEED_STRIDE = 0x9E3779B97F4A7C1


def sample_seed(request_seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n > 1` samples."""
    return (request_seed + index * _SEQUENCE_SEED_STRIDE) % (1 << 62)


# Step records kept for inspection (tests, debugging); older ones are dropped.
_STEP_LOG_SIZE = 4096


class LLMEngine:
    """Requests in, outputs out: queues requests and their n samples, runs the step loop
    (schedule, execute, accept the sampled tokens, stop, emit) and aborts. Set-up builds
    its parts (setup.py); the Speculator checks and proposes drafts around each step
    (speculation.py); WeightsLifecycle updates weights and sleeps and wakes for RL loops
    (weights_lifecycle.py)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.speculation = config.speculation
        parts = build_engine(config)
        self.model_source = parts.source
        self.model_config = parts.model_config
        self.tokenizer: Tokenizer | None = parts.tokenizer
        self.device = parts.device
        self.dtype = parts.dtype
        self.max_model_len = parts.max_model_len
        self.quantization = parts.quantization
        self._tp_workers = parts.tp_workers
        self.runner = parts.runner
        self.draft_runner = parts.draft_runner
        self.mtp = parts.mtp
        self.kv_plan = parts.kv_plan
        self.kv_manager = parts.kv_manager
        self.weights = parts.weights
        self.state_pool = parts.state_pool
        self.scheduler = parts.scheduler
        self.loras = parts.loras
        self.speculator = parts.speculator
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.grammars, self.model_config.vocab_size, self.max_model_len
        )
        self.requests = RequestTable()
        self._rng = random.Random(config.seed)
        self.step_log: deque[StepRecord] = deque(maxlen=_STEP_LOG_SIZE)
        self._num_steps = 0
        log_startup(parts, self.speculation)
        if parts.source.format == "gguf":
            release_pages(parts.source.gguf_reader())  # the model holds its weights now

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

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
            request_id = self.requests.next_free_id(params.n)
        seq_ids = sequence_ids(request_id, params.n)
        taken = self.requests.taken(request_id, params.n)
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
        self.requests.add(parent)
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

    def abort_request(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests wherever they are; their blocks are freed at once. Unknown ids are
        ignored (the request may have just finished)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs = []
        for rid in ids:
            parent = self.requests.remove(rid)
            if parent is None:
                continue
            for sequence in parent.sequences:
                self.scheduler.finish(sequence.request, FinishReason.ABORT)
                self.speculator.forget(sequence.request)
            parent.metrics.finished_time = time.time()
            outputs.append(self._output(parent))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return len(self.requests) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the loop ------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that advanced or finished
        (with `finished_only`, for those that finished: a caller that reads final outputs
        only, as `LLM.generate` does, skips copying every running request's tokens, text
        and logprobs each step)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.time()
        started = time.perf_counter()
        for request_id in sched.preempted:
            self.requests.sequence(request_id)[1].request.queued_time = now
        for item in sched.scheduled:
            parent, _ = self.requests.sequence(item.request_id)
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
        self.speculator.record_step(sched.scheduled, self._siblings, result.hidden_states)
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
            parent, sequence = self.requests.sequence(sched.scheduled[item].request_id)
            stopped = self._process_sample(sequence, out, rows_of[item][position])
            mark_first_token(parent.metrics)
            touched[parent.request_id] = parent
            return stopped

        self.scheduler.update(sched, sampled, on_token)
        for item, scores in result.prompt_scores:
            chunk = sched.scheduled[item]
            parent, _ = self.requests.sequence(chunk.request_id)
            top = chunk.prompt_logprobs or 0
            self.output_processor.record_prompt_logprobs(parent, chunk.start + 1, scores, top)
        if self.speculator.proposer is not None:
            self.speculator.propose()
        self._record_step(sched, now, time.perf_counter() - started, emitted)
        return [
            self._emit(parent)
            for parent in touched.values()
            if parent.finished or not finished_only
        ]

    def _siblings(self, sequence_id: str) -> list[str]:
        """The ids of every sample of the request `sequence_id` belongs to."""
        parent, _ = self.requests.sequence(sequence_id)
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
            parent = self.requests.sequence(chunk.request_id)[0]
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
            self.requests.remove(parent.request_id)
            for sequence in parent.sequences:
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
