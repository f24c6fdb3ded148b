"""Drafts from a model: a smaller one with the target's tokenizer, or the target's own first
layers with its final norm and head (self-speculation). The draft decodes greedily; the
target checks its guesses as it checks any proposer's, so outputs stay the target's.

The draft's KV cache mirrors the target's blocks: its own tensors, indexed by the target's
block ids, so the target's block tables, reservations and releases serve both. A sequence's
draft K/V are trusted up to `DraftProgress.num_computed` positions, which never exceeds the
target's count (rejected drafts fall out) and restarts after a preemption (new blocks). The
draft catches up on the positions it has not seen (a new prompt, a draft accepted whole)
before it guesses; what it writes past those positions only ever hurts its own guesses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from forklift.checkpoint.source import ModelSource, resolve_model
from forklift.config import EngineConfig
from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.scheduler_output import SamplingRow, ScheduledChunk
from forklift.model.kv_layout import kv_layout
from forklift.model.model_config import ModelConfig
from forklift.model.model_source import iter_model_weights, load_model_config, quantization_plan
from forklift.model.quantize import resolve_quantization
from forklift.runner.model_runner import ModelRunner
from forklift.sampling_params import SamplingParams
from forklift.spec_decode.proposer import (
    DraftQuery,
    release_unverified_slots,
    reserve_guess_slots,
)
from forklift.speculative_config import SpeculativeConfig

# A catch-up longer than this runs as chunks (PyTorch's prefill layers); shorter ones feed
# one row per token in one forward, so the rounds stay decode steps the native step takes.
LONG_CATCH_UP = 4
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class DraftSpec:
    """The draft model, checked: where it is, its checkpoint's shape and the shape run."""

    source: ModelSource
    checkpoint: ModelConfig
    config: ModelConfig


def resolve_draft(
    spec: SpeculativeConfig,
    config: EngineConfig,
    target_source: ModelSource,
    target_config: ModelConfig,
) -> DraftSpec:
    """The draft, checked against the target before any weight loads: same tokens, one KV
    layout for all its layers, one rank."""
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config: method 'draft_model' runs with tensor_parallel_size 1 only"
        )
    _check_single_group("the target model", target_config)
    source = target_source
    if spec.model is not None:
        try:
            source = resolve_model(spec.model)
        except (OSError, ValueError) as exc:
            raise ValueError(f"speculative_config: model {spec.model!r}: {exc}") from exc
    checkpoint = load_model_config(source)
    _check_single_group("the draft model", checkpoint)
    if checkpoint.vocab_size > target_config.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({checkpoint.vocab_size} "
            f"tokens) is larger than the target's ({target_config.vocab_size}); they must "
            "share a tokenizer"
        )
    num_layers = checkpoint.num_layers if spec.draft_layers is None else spec.draft_layers
    if num_layers > checkpoint.num_layers:
        raise ValueError(
            f"speculative_config: draft_layers must be at most the draft model's "
            f"{checkpoint.num_layers} layers, got {num_layers}"
        )
    draft = dataclasses.replace(
        checkpoint, num_layers=num_layers, layer_types=checkpoint.layer_types[:num_layers]
    )
    return DraftSpec(source, checkpoint, draft)


def load_draft_runner(
    draft: DraftSpec,
    config: EngineConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> ModelRunner:
    """The draft model on its own runner, in its own precision (a GGUF draft on its block
    kernels)."""
    method = resolve_quantization(config.quantization, config.dtype, draft.source.format, device)
    return ModelRunner(
        draft.config,
        partial(_first_layers_weights, draft.source, draft.checkpoint, draft.config.num_layers),
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        block_size=config.block_size,
        sliding_window=draft.config.uniform_window,
        quantization=quantization_plan(draft.source, draft.checkpoint, method),
        decode_backend=config.decode_backend,
        batch_invariant=config.batch_invariant,
        kv_cache_dtype=config.resolve_kv_cache_dtype(device),
    )


def _check_single_group(what: str, model_config: ModelConfig) -> None:
    """One KV group of attention layers: the target's block tables serve the draft whole
    (a window the same for every layer masks positions but keeps their blocks)."""
    if model_config.is_hybrid or kv_layout(model_config).windows != (None,):
        raise ValueError(
            f"speculative_config: method 'draft_model' needs attention layers sharing one "
            f"KV layout; {what} ({model_config.architecture}) has linear layers or layers "
            "with windows of their own"
        )


def _first_layers_weights(
    source: ModelSource, model_config: ModelConfig, num_layers: int, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but those of layers from `num_layers` on (and `skip`)."""
    for name, tensor in iter_model_weights(source, model_config, skip):
        match = _LAYER_NAME.search(name)
        if match is None or int(match.group(1)) < num_layers:
            yield name, tensor


@dataclass
class DraftProgress:
    """How far one sequence's draft K/V hold its own tokens."""

    num_computed: int = 0
    num_preemptions: int = 0


@dataclass
class _Drafting:
    """One sequence within a call: tokens still to feed from `position`, drafts so far."""

    query: DraftQuery
    position: int
    pending: list[int]
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(
        self, runner: ModelRunner, kv_manager: KVCacheManager, max_chunk_tokens: int
    ) -> None:
        self.runner = runner
        self.kv_manager = kv_manager
        # A forward's catch-up tokens at most (the target's step budget): a long prompt is
        # fed over several forwards, within the activations the memory plan measured.
        self.max_chunk_tokens = max_chunk_tokens
        self._progress: dict[str, DraftProgress] = {}
        # Greedy rows: the draft's best guess (any guess keeps the output the target's).
        self._greedy = SamplingRow(SamplingParams(temperature=0.0), 0, (), ())

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        started = [self._start(query) for query in queries]
        live = [item for item in started if item is not None]
        while live:
            live = self._forward(live)
        for item in started:
            if item is not None:
                release_unverified_slots(self.kv_manager, item.query, len(item.drafts))
        return [[] if item is None else item.drafts for item in started]

    def _forward(self, live: list[_Drafting]) -> list[_Drafting]:
        """One draft forward over the live sequences: the tokens each has still to feed (a
        short run as one row each, which the native step takes; a long one as chunks within
        the token budget) and, once it has fed them all, its next guess. Returns the
        sequences with more to feed or guess."""
        chunks: list[ScheduledChunk] = []
        fed: list[tuple[_Drafting, int, int]] = []  # (sequence, tokens fed, its last row)
        budget = self.max_chunk_tokens
        for item in live:
            pending = item.pending
            table = self.kv_manager.block_table(item.query.request_id)
            if len(pending) > LONG_CATCH_UP:
                take = min(len(pending), budget)
                if take == 0:
                    continue  # the next forward feeds it
                budget -= take
                runs = [(0, take)]
            else:
                runs = [(offset, 1) for offset in range(len(pending))]
            for offset, length in runs:
                chunks.append(ScheduledChunk(
                    item.query.request_id, pending[offset : offset + length],
                    item.position + offset, table, sampling=self._greedy,
                ))  # fmt: skip
            fed.append((item, runs[-1][0] + runs[-1][1], len(chunks) - 1))
        output = self.runner.execute(chunks).sampler_output
        assert output is not None
        done = set()
        for item, count, row in fed:
            item.position += count
            del item.pending[:count]
            self._progress[item.query.request_id].num_computed = item.position
            if item.pending:
                continue  # still catching up: the row's token is no guess
            token = output.token_ids[row]
            item.drafts.append(token)
            if len(item.drafts) < item.query.max_tokens:
                item.pending = [token]
            else:
                done.add(id(item))
        return [item for item in live if id(item) not in done]

    def _start(self, query: DraftQuery) -> _Drafting | None:
        """Reserve the blocks of the positions this call writes; None when the sequence
        wants no drafts or the pool has no room for them."""
        progress = self._progress.get(query.request_id)
        if progress is None or progress.num_preemptions != query.num_preemptions:
            progress = DraftProgress(0, query.num_preemptions)
            self._progress[query.request_id] = progress
        progress.num_computed = min(progress.num_computed, query.num_computed_tokens)
        if query.max_tokens <= 0:
            return None
        if not reserve_guess_slots(self.kv_manager, query, query.max_tokens):
            return None
        start = progress.num_computed
        return _Drafting(query, start, list(query.token_ids[start:]))

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._progress.pop(request_id, None)
