"""Drafts from the checkpoint's multi-token prediction layer (Qwen3.5's `mtp.*`,
model/mtp_layer.py), which reads the target's final hidden states.

The layer's K/V at position p come from the target's hidden state at p and the token at
p + 1, so it must see every position the target computes: the engine hands it each step's
hidden states (`record_step`) and asks about every running sequence after each step, and
the layer catches up in one chunk on the positions whose next token is known. For a
sequence asking for drafts, that chunk's last output guesses the token after the newest,
and each further guess feeds the layer's own output back, one position on. The
K/V of guesses are never trusted later (they came from the layer's output, not the target's
hidden state): the next call starts again at the target's count. The cache has the target's
block count and is indexed by the target's block ids, as a draft model's.

Where the target runs the native step on dense bf16 tiles, so does the layer, bound as a
one-layer model beside it (model/native_binding.py's `MtpStepBinding`: one call a round,
the target's packed head reused); calls of more rows than that step takes, and every other
target, run the PyTorch layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forklift.checkpoint.source import ModelSource
from forklift.core.kv_cache_manager import KVCacheManager
from forklift.core.scheduler_output import ScheduledChunk
from forklift.model.kv_cache_dtype import kv_cache_format
from forklift.model.layers.linear import Linear
from forklift.model.llama import LayerCache
from forklift.model.model_config import ModelConfig
from forklift.model.model_source import iter_model_weights
from forklift.model.mtp_layer import MultiTokenPredictor
from forklift.model.native_binding import MtpStepBinding
from forklift.runner.memory import kv_block_bytes, module_bytes
from forklift.runner.model_runner import ModelRunner
from forklift.spec_decode.proposer import (
    DraftQuery,
    release_unverified_slots,
    reserve_guess_slots,
)


def check_mtp(source: ModelSource, model_config: ModelConfig, tensor_parallel_size: int) -> None:
    """Refuse, before any weight loads, a model whose MTP layer cannot run here."""
    if not (model_config.is_hybrid and model_config.attention_output_gate):
        raise ValueError(
            "speculative_config: method 'mtp' runs Qwen3.5 checkpoints, whose MTP layer it "
            f"loads; this model is {model_config.architecture}"
        )
    if source.format != "hf":
        raise ValueError(
            "speculative_config: method 'mtp' reads the MTP layer from an HF checkpoint "
            "directory (safetensors), not a GGUF file"
        )
    if tensor_parallel_size > 1:
        raise ValueError("speculative_config: method 'mtp' runs with tensor_parallel_size 1")


def load_mtp(
    source: ModelSource,
    model_config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> MultiTokenPredictor:
    """The checkpoint's MTP layer (`check_mtp` first)."""
    with torch.device(device):
        mtp = MultiTokenPredictor(model_config, max_model_len)
    mtp.load_weights(iter_model_weights(source, model_config))
    mtp = mtp.to(dtype).eval().requires_grad_(False)
    for module in mtp.modules():
        if isinstance(module, Linear):
            module.pack()
    return mtp


def mtp_weight_bytes(mtp: MultiTokenPredictor, dense_step: bool = False) -> int:
    """The layer's parameters and buffers, and its linears' packed copies: oneDNN's, and
    with `dense_step` (the target runs dense tiles, so the layer does too) the tiles'."""
    linears = [m for m in mtp.modules() if isinstance(m, Linear)]
    packed = [m.packed_weight for m in linears if m.packed_weight is not None]
    tiles = [m.weight for m in linears] if dense_step else []
    return module_bytes(mtp) + sum(t.numel() * t.element_size() for t in [*packed, *tiles])


def mtp_block_bytes(mtp: MultiTokenPredictor, block_size: int) -> int:
    """The layer's K/V in one block."""
    return kv_block_bytes(
        mtp.layer_config, kv_cache_format("auto", mtp.fc.weight.dtype), block_size
    )


@dataclass
class MtpProgress:
    """One sequence: its MTP K/V hold positions [0, num_computed); the target's hidden
    states of positions [hidden_start, hidden_start + len(hidden)) wait to be consumed."""

    num_computed: int = 0
    hidden_start: int = 0
    hidden: torch.Tensor | None = None

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + (0 if self.hidden is None else self.hidden.shape[0])

    def add(self, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states of positions [start, start + len(rows))."""
        # A preempted sequence computed again from 0, or resumed from the prefix cache: the
        # layer's K/V hold positions up to where it starts again (num_computed never passes
        # hidden_start, so nothing else needs resetting).
        if start < self.num_computed:
            self.num_computed = start
        if self.hidden is None or not self.hidden_start <= start <= self.hidden_end:
            self.hidden_start, self.hidden = start, rows
        else:  # rows past `start` held rejected drafts
            self.hidden = torch.cat([self.hidden[: start - self.hidden_start], rows])

    def rows(self, start: int, end: int) -> torch.Tensor | None:
        """The kept hidden states of positions [start, end); None when some are missing."""
        if self.hidden is None or start < self.hidden_start or end > self.hidden_end:
            return None
        return self.hidden[start - self.hidden_start : end - self.hidden_start]

    def consumed(self, position: int) -> None:
        """The MTP K/V now hold positions up to `position`: drop the rows before it."""
        self.num_computed = position
        if self.hidden is not None:
            cut = min(max(position - self.hidden_start, 0), self.hidden.shape[0])
            self.hidden, self.hidden_start = self.hidden[cut:], self.hidden_start + cut


@dataclass
class _Guessing:
    """One sequence within a call: its layer catches up to `end` (the positions whose next
    token is known), then guesses `guesses` tokens."""

    query: DraftQuery
    progress: MtpProgress
    end: int
    guesses: int
    drafts: list[int] = field(default_factory=list)


class MtpProposer:
    def __init__(
        self, mtp: MultiTokenPredictor, runner: ModelRunner, kv_manager: KVCacheManager
    ) -> None:
        self.mtp = mtp
        self.runner = runner
        self.kv_manager = kv_manager
        self.cache: LayerCache | None = None
        self._progress: dict[str, MtpProgress] = {}
        self._binding: MtpStepBinding | None = None
        runner.keep_hidden_states = True
        # The model's decode kernel serves the layer's decode rows too.
        attention = next(layer for layer in runner.model.layers if layer.is_full_attention)
        mtp.layers[0].decode_attention = attention.decode_attention

    def allocate_cache(self, num_blocks: int) -> None:
        config = self.mtp.layer_config
        # Zeros: masked positions of never-written blocks must not hold NaNs.
        shape = (2, config.num_kv_heads, num_blocks, self.runner.block_size, config.head_dim)
        cache = torch.zeros(shape, dtype=self.mtp.fc.weight.dtype, device=self.runner.device)
        self.cache = (cache[0], cache[1])
        self._binding = None  # it points into the old cache

    def free_cache(self) -> None:
        self.cache = None
        self._binding = None
        self._progress.clear()

    def record_step(self, scheduled: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Keep the step's final hidden states, each chunk's rows in order."""
        first = 0
        for chunk in scheduled:
            rows = hidden[first : first + chunk.num_new_tokens].detach().clone()
            first += chunk.num_new_tokens
            progress = self._progress.get(chunk.request_id)
            if progress is None:
                # A sequence resumed from the prefix cache starts where its first chunk does:
                # the layer's K/V before it are the cached blocks', written by the request
                # that computed them (their last position from that request's next token:
                # a guess may differ, never an output).
                progress = MtpProgress(num_computed=chunk.start, hidden_start=chunk.start)
                self._progress[chunk.request_id] = progress
            progress.add(chunk.start, rows)

    def knows(self, request_id: str) -> bool:
        return request_id in self._progress

    def fork(self, source_id: str, target_id: str, position: int) -> None:
        """`target` shares `source`'s blocks before `position` (a sample of the same prompt):
        it shares the layer's K/V in them and the kept hidden states up to there."""
        source = self._progress.get(source_id)
        if source is None:
            return
        start = min(source.num_computed, position)
        rows = source.rows(start, position) if start < position else None
        if start < position and rows is None:
            return  # the hidden states it would catch up on are gone: it starts afresh
        fork = MtpProgress(num_computed=start, hidden_start=start)
        if rows is not None:
            fork.hidden = rows.clone()
        self._progress[target_id] = fork

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        """Guesses for the queries asking for some; every query's sequence catches up."""
        assert self.cache is not None, "the MTP cache was freed (sleep): wake the engine"
        live = [g for q in queries if (g := self._start(q)) is not None]
        if live:
            with torch.inference_mode():
                self._guess(live)
        for item in live:
            if item.guesses:
                release_unverified_slots(self.kv_manager, item.query, len(item.drafts))
        by_id = {item.query.request_id: item.drafts for item in live}
        return [by_id.get(q.request_id, []) for q in queries]

    def _start(self, query: DraftQuery) -> _Guessing | None:
        progress = self._progress.get(query.request_id)
        if progress is None:
            return None
        # The layer reads the token after each position: up to the newest token's.
        end = min(query.num_computed_tokens, len(query.token_ids) - 1)
        progress.num_computed = min(progress.num_computed, end)
        if progress.num_computed == end or progress.rows(progress.num_computed, end) is None:
            return None
        guesses = query.max_tokens if end == query.num_computed_tokens else 0
        if guesses and not reserve_guess_slots(self.kv_manager, query, guesses):
            guesses = 0
        return _Guessing(query, progress, end, guesses)

    def _guess(self, live: list[_Guessing]) -> None:
        chunks, inputs = [], []
        for item in live:
            start = item.progress.num_computed
            rows = item.progress.rows(start, item.end)
            assert rows is not None
            chunks.append(self._chunk(item.query, item.query.token_ids[start + 1 : item.end + 1],
                                      start))  # fmt: skip
            inputs.append(rows)
        last = torch.tensor([c.num_new_tokens for c in chunks]).cumsum(0) - 1
        guessing = [i for i, item in enumerate(live) if item.guesses]
        outputs, logits = self._forward(chunks, torch.cat(inputs), last[guessing])
        for item in live:  # the catch-up is consumed: guesses never enter the kept K/V
            item.progress.consumed(item.end)
        live, outputs = [live[i] for i in guessing], outputs[last[guessing]]
        rounds = 0
        while live:
            tokens = logits.argmax(-1).tolist()
            still, kept = [], []
            for index, (item, token) in enumerate(zip(live, tokens, strict=True)):
                item.drafts.append(token)
                if len(item.drafts) < item.guesses:
                    still.append(item)
                    kept.append(index)
            live, rounds = still, rounds + 1
            if not live:
                break
            chunks = [
                self._chunk(item.query, [item.drafts[-1]], item.end + rounds - 1)
                for item in live
            ]  # fmt: skip
            outputs, logits = self._forward(chunks, outputs[kept], torch.arange(len(chunks)))

    def _chunk(self, query: DraftQuery, tokens: Sequence[int], start: int) -> ScheduledChunk:
        table = self.kv_manager.block_table(query.request_id)
        return ScheduledChunk(query.request_id, list(tokens), start, table)

    def _forward(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor, logit_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over `chunks` (`hidden`: each row's input state): every row's normed
        output, and the logits of `logit_rows` (ascending)."""
        assert self.cache is not None
        ids = torch.tensor([t for chunk in chunks for t in chunk.token_ids], dtype=torch.int64,
                           device=self.runner.device)  # fmt: skip
        binding = self._native_binding()
        if binding is not None and ids.numel() <= (binding.max_rows or ids.numel()):
            rows, positions = self.runner.input_builder.row_attention_inputs(chunks)
            groups = [(rows.slot_mapping, rows.kv_blocks, rows.bias)]
            output = self.runner.native_step(
                binding, ids, positions, groups, logit_rows=logit_rows, keep_hidden=True,
                input_hidden=hidden,
            )  # fmt: skip
            assert output.hidden is not None
            return output.hidden, output.logits
        meta, positions = self.runner.input_builder.attention_inputs(chunks)
        embedded = self.runner.model.embed_tokens(ids)
        outputs = self.mtp(embedded, hidden.to(embedded.dtype), positions, self.cache, meta)
        return outputs, self.runner.model.compute_logits(outputs[logit_rows])

    def _native_binding(self) -> MtpStepBinding | None:
        """The layer bound beside the target's native step on dense tiles, bound again when
        the target's binding changes; None where the PyTorch layer runs."""
        target = self.runner.backend.binding
        if self.runner.native_step is None or target is None or not target.model.head.dense:
            return None
        if self.mtp.fc.weight.dtype != torch.bfloat16 or self.cache is None:
            return None
        if self._binding is None or self._binding.target is not target:
            reuse = self._binding.dense_buffer if self._binding is not None else None
            self._binding = MtpStepBinding(self.mtp, target, self.cache, reuse)
        return self._binding

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        self._progress.pop(request_id, None)
