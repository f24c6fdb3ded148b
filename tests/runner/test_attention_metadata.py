"""The step's attention metadata: the decode-only fast path builds what the general one does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forklift.runner.attention_metadata import build_attention_metadata


@pytest.mark.parametrize("min_kv_width", [0, 64, 200])
def test_decode_rows_get_the_general_paths_tensors(min_kv_width):
    """A window wider than any context masks nothing, so the general path (which a window
    takes) must agree with the decode fast path field by field."""
    rng = np.random.default_rng(0)
    block_size, rows, width = 16, 5, 12
    starts = np.array([0, 15, 16, 100, 170], dtype=np.int64)
    table = rng.integers(1, 500, size=(rows, width)).astype(np.int64)
    cpu = torch.device("cpu")
    ones = np.ones(rows, dtype=np.int64)
    fast, fast_positions = build_attention_metadata(
        starts, ones, table, block_size, None, cpu, min_kv_width
    )
    general, positions = build_attention_metadata(
        starts, ones, table, block_size, 10**9, cpu, min_kv_width
    )
    assert np.array_equal(fast_positions, positions)
    assert torch.equal(fast.slot_mapping, general.slot_mapping)
    (mine,), (theirs,) = fast.groups, general.groups
    for field in ("query_index", "padded_index", "token_index", "kv_blocks", "mask"):
        assert torch.equal(getattr(mine, field), getattr(theirs, field)), field
    assert mine.mask.dtype == torch.float32 and bool(torch.isneginf(mine.mask).any())
