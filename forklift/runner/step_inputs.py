"""A scheduled step as the model's flat inputs (`StepInputs`): token ids, positions, the
PyTorch layers' attention metadata or the native step's rows, the rows that sample or score
their prompt, and the cache writes the step needs before its forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from forklift.core.scheduler_output import ScheduledChunk
from forklift.model.kv_layout import KVLayout
from forklift.model.layers.attention import AttentionMetadata
from forklift.model.layers.gated_deltanet import LinearAttentionMetadata
from forklift.model.model_config import ModelConfig
from forklift.runner.attention_metadata import (
    RowAttention,
    build_attention_metadata,
    build_row_attention,
)
from forklift.runner.cache_tensors import CacheTensors
from forklift.runner.decode_capture import CaptureKey, DecodeCapture
from forklift.runner.linear_metadata import build_linear_metadata, native_state_rows
from forklift.runner.prompt_scores import prompt_rows_of


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    # The PyTorch layers' attention metadata; None for a step the native step runs, which
    # reads `row_attention` instead.
    meta: AttentionMetadata | None
    # Flat index of the last token of each sequence that samples this step.
    sample_index: torch.Tensor
    # Blocks this step reads for the first time since the cache was allocated: zeroed first,
    # since attention reads whole blocks and never-written memory may hold NaNs.
    fresh_blocks: torch.Tensor
    # Hybrid models: [n, 2] (source, target) state slots to copy before the step (a sample
    # of n > 1 forks its prompt's state).
    state_copies: torch.Tensor | None = None
    # [n, 2] (source, target) KV blocks to copy before the step, every layer's (a sample of
    # n > 1 takes its leader's partly filled last prompt block).
    block_copies: torch.Tensor | None = None
    # Prompt logprobs: flat rows scored, the prompt token each predicts, how many top tokens.
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_top: int = 0
    # The native step's attention, one row per token, per KV group.
    row_attention: list[RowAttention] | None = None
    # A hybrid's native step: each token's state slot read and written (-1: none).
    state_rows: tuple[torch.Tensor, torch.Tensor] | None = None


class StepInputBuilder:
    """Builds one runner's `StepInputs` from its scheduled rows: block tables per KV group
    and window, the cache's blocks read for the first time, and the captured shape a
    pure-decode step is padded to."""

    def __init__(
        self,
        config: ModelConfig,
        layout: KVLayout,
        *,
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
        cache: CacheTensors,
        capture: DecodeCapture | None,
    ) -> None:
        """`config`: the model's (this rank's) shape; `cache`: the runner's, whose first-use
        bookkeeping each step advances."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self._windows = layout.windows
        # Only a hybrid model's linear layers read linear metadata.
        self._linear = config.linear_attention if config.is_hybrid else None
        self._cache = cache
        self._capture = capture

    def capture_key(self, scheduled: list[ScheduledChunk]) -> CaptureKey | None:
        """The captured shape for a pure-decode step; None runs the step eagerly."""
        capture = self._capture
        if capture is None or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        key = capture.key_for(len(scheduled), max(s.start for s in scheduled) + 1)
        if key is None:
            capture.stats.eager_fallbacks += 1
        return key

    def prepare(
        self,
        scheduled: list[ScheduledChunk],
        *,
        pad_to: int | None = None,
        kv_width: int = 0,
        state_copies: Sequence[tuple[int, int]] = (),
        block_copies: Sequence[tuple[int, int]] = (),
        native: bool = False,
    ) -> StepInputs:
        """Flat step inputs. `pad_to` appends decode rows of token 0 at position 0 in the null
        block (they sample nothing); `kv_width` widens the key tensors to a fixed size;
        `native`: the native step's per-token attention instead of the PyTorch layers'."""
        starts = np.array([s.start for s in scheduled], dtype=np.int64)
        query_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        ids = np.concatenate([np.asarray(s.token_ids) for s in scheduled]).astype(np.int64)
        sampling = np.array([s.samples for s in scheduled], dtype=bool)
        rows = len(scheduled) if pad_to is None else pad_to
        padding = rows - len(scheduled)
        if padding:
            starts = np.concatenate([starts, np.zeros(padding, dtype=np.int64)])
            query_lens = np.concatenate([query_lens, np.ones(padding, dtype=np.int64)])
            ids = np.concatenate([ids, np.zeros(padding, dtype=np.int64)])
            sampling = np.concatenate([sampling, np.zeros(padding, dtype=bool)])
        tables = _group_tables(scheduled, rows, len(self._windows))
        row_attention = None
        if native:
            meta = None
            row_attention, positions = build_row_attention(
                starts, query_lens, tables, self._group_windows, self.block_size, self.device
            )
        else:
            meta, positions = self.attention_metadata(starts, query_lens, tables, kv_width)
        count = len(scheduled)  # padding rows never reach a linear layer: hybrids run eagerly
        slots = np.array([s.state_slot for s in scheduled], dtype=np.int64)
        # Rows verifying a hybrid's drafts read the state the row before them writes.
        continues = np.array([s.state_read_slot >= 0 for s in scheduled], dtype=bool)
        reads = np.where(continues, [s.state_read_slot for s in scheduled], slots)
        state_rows = None
        if meta is not None:
            meta.linear = self.linear_metadata(
                starts[:count], query_lens[:count], slots, reads, continues
            )
        elif self._linear is not None:
            state_rows = native_state_rows(
                starts[:count], query_lens[:count], slots, reads, continues, self.device
            )
        copies = np.asarray(state_copies, dtype=np.int64).reshape(-1, 2)
        block_pairs = np.asarray(block_copies, dtype=np.int64).reshape(-1, 2)
        self._cache.mark_written(block_pairs[:, 1])
        ends = np.cumsum(query_lens)
        sample_index = (ends - 1)[sampling]
        inputs = StepInputs(
            input_ids=torch.from_numpy(ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            meta=meta,
            sample_index=torch.from_numpy(sample_index).to(self.device),
            fresh_blocks=torch.from_numpy(
                self._cache.take_unwritten(np.concatenate(tables, axis=1))
            ).to(self.device),
            state_copies=torch.from_numpy(copies).to(self.device) if copies.size else None,
            block_copies=(
                torch.from_numpy(block_pairs).to(self.device) if block_pairs.size else None
            ),
            row_attention=row_attention,
            state_rows=state_rows,
        )
        asked = prompt_rows_of(scheduled, ends - query_lens)
        if asked is not None:
            rows, targets, inputs.prompt_top = asked
            inputs.prompt_rows = torch.from_numpy(rows).to(self.device)
            inputs.prompt_targets = torch.from_numpy(targets).to(self.device)
        return inputs

    @property
    def _group_windows(self) -> list[int | None]:
        """Each KV group's window (Mistral's uniform one for the first)."""
        windows = list(self._windows)
        return [self.sliding_window or windows[0], *windows[1:]]

    def attention_metadata(
        self,
        starts: np.ndarray,
        query_lens: np.ndarray,
        tables: list[np.ndarray],
        kv_width: int = 0,
    ) -> tuple[AttentionMetadata, np.ndarray]:
        """The first KV group's metadata (with Mistral's uniform window, or the group's) and
        each token's position; with several groups, every group's metadata as `kv_groups`."""
        windows = self._windows
        meta, positions = build_attention_metadata(
            starts,
            query_lens,
            tables[0],
            self.block_size,
            self.sliding_window or windows[0],
            self.device,
            kv_width,
        )
        if len(tables) > 1:
            meta.kv_groups = [meta] + [
                build_attention_metadata(
                    starts, query_lens, table, self.block_size, window, self.device, kv_width
                )[0]
                for table, window in zip(tables[1:], windows[1:], strict=True)
            ]
        return meta, positions

    def linear_metadata(
        self,
        starts: np.ndarray,
        query_lens: np.ndarray,
        slots: np.ndarray,
        read_slots: np.ndarray | None = None,
        continues: np.ndarray | None = None,
    ) -> LinearAttentionMetadata | None:
        """A hybrid model's linear layers' metadata; None for a model without them."""
        if self._linear is None:
            return None
        return build_linear_metadata(
            starts, query_lens, slots, self._linear.conv_kernel, self.device, read_slots,
            continues,
        )  # fmt: skip

    def attention_inputs(
        self, scheduled: list[ScheduledChunk]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata and positions of chunks a drafter runs over the target's
        blocks in a cache of its own (the target's first-use bookkeeping is left alone)."""
        meta, positions = self.attention_metadata(*_drafter_rows(scheduled))
        return meta, torch.from_numpy(positions).to(self.device)

    def row_attention_inputs(
        self, scheduled: list[ScheduledChunk]
    ) -> tuple[RowAttention, torch.Tensor]:
        """The native step's row attention (the first KV group's) and positions of the same
        chunks (`attention_inputs`' for a drafter the native step runs)."""
        starts, query_lens, tables = _drafter_rows(scheduled)
        rows, positions = build_row_attention(
            starts, query_lens, tables, self._group_windows[:1], self.block_size, self.device
        )
        return rows[0], torch.from_numpy(positions).to(self.device)


def _drafter_rows(
    scheduled: list[ScheduledChunk],
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """A drafter's chunks as starts, query lengths and the first KV group's block tables."""
    starts = np.array([s.start for s in scheduled], dtype=np.int64)
    query_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
    return starts, query_lens, _group_tables(scheduled, len(scheduled), 1)


def _group_tables(scheduled: list[ScheduledChunk], rows: int, num_groups: int) -> list[np.ndarray]:
    """Each KV group's block tables as one [rows, width] array (padding rows: the null
    block)."""
    per_row = [s.group_tables or (s.block_table,) for s in scheduled]
    width = max(len(t[0]) for t in per_row)
    tables = [np.zeros((rows, width), dtype=np.int64) for _ in range(num_groups)]
    for row, chunk_tables in enumerate(per_row):
        for group, table in enumerate(chunk_tables):
            tables[group][row, : len(table)] = table
    return tables
