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
from collections.abc import Iterator, Sequence
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
from forklift.spec_decode.config import SpeculativeConfig
from forklift.spec_decode.proposer import DraftQuery

# A catch-up this long runs as one chunk (PyTorch's prefill layers); shorter ones feed a
# token per forward, so the rounds stay decode steps the native step runs whole.
LONG_CATCH_UP = 4
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def load_draft_runner(
    spec: SpeculativeConfig,
    config: EngineConfig,
    target_source: ModelSource,
    target_config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> ModelRunner:
    """The draft model on its own runner, checked against the target before its weights
    load: same tokens, one KV group of attention layers, one rank."""
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config: method 'draft_model' runs with tensor_parallel_size 1 only"
        )
    _check_single_group("the target model", target_config)
    source = target_source if spec.model is None else resolve_model(spec.model)
    full = load_model_config(source)
    _check_single_group("the draft model", full)
    if full.vocab_size > target_config.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({full.vocab_size} tokens) is "
            f"larger than the target's ({target_config.vocab_size}); they must share a tokenizer"
        )
    num_layers = full.num_layers if spec.draft_layers is None else spec.draft_layers
    if num_layers > full.num_layers:
        raise ValueError(
            f"speculative_config: draft_layers must be at most the draft model's "
            f"{full.num_layers} layers, got {num_layers}"
        )
    draft = dataclasses.replace(
        full, num_layers=num_layers, layer_types=full.layer_types[:num_layers]
    )
    method = resolve_quantization(config.quantization, config.dtype, source.format, device)
    return ModelRunner(
        draft,
        partial(_first_layers_weights, source, full, num_layers),
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        block_size=config.block_size,
        sliding_window=draft.uniform_window,
        quantization=quantization_plan(source, full, method),
        decode_backend=config.decode_backend,
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
    source: ModelSource, model_config: ModelConfig, num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but those of layers from `num_layers` on."""
    for name, tensor in iter_model_weights(source, model_config):
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
    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager) -> None:
        self.runner = runner
        self.kv_manager = kv_manager
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
                # Verification needs the newest token's and the drafts' blocks, no more.
                request_id = item.query.request_id
                self.kv_manager.release_tail(
                    request_id, len(item.query.token_ids) + len(item.drafts)
                )
        return [[] if item is None else item.drafts for item in started]

    def _forward(self, live: list[_Drafting]) -> list[_Drafting]:
        """One draft forward over every live sequence: its tokens still to feed (a short run
        as one row each, which the native step takes; a long one as a chunk) and the guess
        after them. Returns the sequences with more to guess."""
        chunks: list[ScheduledChunk] = []
        last_row: list[int] = []
        for item in live:
            table = self.kv_manager.block_table(item.query.request_id)
            step = len(item.pending) if len(item.pending) > LONG_CATCH_UP else 1
            for offset in range(0, len(item.pending), step):
                chunks.append(ScheduledChunk(
                    item.query.request_id, item.pending[offset : offset + step],
                    item.position + offset, table, sampling=self._greedy,
                ))  # fmt: skip
            last_row.append(len(chunks) - 1)
        output = self.runner.execute(chunks).sampler_output
        assert output is not None
        still = []
        for item, row in zip(live, last_row, strict=True):
            item.position += len(item.pending)
            self._progress[item.query.request_id].num_computed = item.position
            token = output.token_ids[row]
            item.drafts.append(token)
            if len(item.drafts) < item.query.max_tokens:
                item.pending = [token]
                still.append(item)
        return still

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
        # Fed: the newest token and every draft but the last.
        if not self.kv_manager.allocate_slots(
            query.request_id, len(query.token_ids) + query.max_tokens - 1
        ):
            return None
        start = progress.num_computed
        return _Drafting(query, start, list(query.token_ids[start:]))

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._progress.pop(request_id, None)
