"""The gated delta rule's two forms, and the flat-batch causal conv, against references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from forklift.model.layers.gated_delta_rule import (
    chunked_gated_delta_rule,
    recurrent_gated_delta_step,
)
from forklift.model.layers.gated_deltanet import causal_conv, delta_rule
from forklift.runner.linear_metadata import build_linear_metadata


def _inputs(batch: int, length: int, heads: int = 3, key_dim: int = 8, value_dim: int = 5):
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    q = F.normalize(torch.randn(batch, length, heads, key_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(batch, length, heads, value_dim, generator=gen)
    g = -2 * torch.rand(batch, length, heads, generator=gen)
    beta = torch.rand(batch, length, heads, generator=gen)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return q * key_dim**-0.5, k, v, g, beta, state


def _recurrent(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[1]):
        out, state = recurrent_gated_delta_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state
        )
        outs.append(out)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_form_equals_the_token_by_token_recurrence(length):
    q, k, v, g, beta, state = _inputs(2, length)
    expected, expected_state = _recurrent(q, k, v, g, beta, state)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(final, expected_state, atol=1e-5)


def test_the_state_carries_across_chunk_calls_and_matches_transformers():
    q, k, v, g, beta, state = _inputs(2, 97)
    head, head_state = chunked_gated_delta_rule(q[:, :40], k[:, :40], v[:, :40], g[:, :40],
                                                beta[:, :40], state)  # fmt: skip
    tail, final = chunked_gated_delta_rule(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:],
                                           beta[:, 40:], head_state)  # fmt: skip
    # transformers' reference scales q itself: give it the unscaled queries.
    ref, ref_state = hf.torch_chunk_gated_delta_rule(
        q * 8**0.5, k, v, g, beta, initial_state=state, output_final_state=True
    )
    assert torch.allclose(torch.cat([head, tail], 1), ref, atol=1e-5)
    assert torch.allclose(final, ref_state, atol=1e-5)


def test_padding_rows_leave_the_state_alone():
    q, k, v, g, beta, state = _inputs(1, 10)
    pad = [torch.cat([x, torch.zeros_like(x[:, :6])], 1) for x in (q, k, v, g, beta)]
    _, expected = chunked_gated_delta_rule(q, k, v, g, beta, state)
    _, padded = chunked_gated_delta_rule(*pad, state)
    assert torch.allclose(padded, expected, atol=1e-6)


def test_flat_batch_conv_equals_a_conv_per_sequence():
    kernel, channels = 4, 6
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(channels, 1, kernel, generator=gen)
    # Three sequences: a fresh prompt chunk, a decode with history, a later prompt chunk.
    starts, lens, slots = np.array([0, 9, 2]), np.array([5, 1, 7]), np.array([3, 1, 2])
    history = {s: torch.randn(starts[i], channels, generator=gen) for i, s in enumerate(slots)}
    pool = torch.zeros(4, kernel - 1, channels)
    for slot, past in history.items():
        tail = past[-(kernel - 1) :]
        pool[slot, kernel - 1 - tail.shape[0] :] = tail
    x = torch.randn(int(lens.sum()), channels, generator=gen)
    meta = build_linear_metadata(starts, lens, slots, kernel, torch.device("cpu"))
    out, new_states = causal_conv(
        x, weight, pool.index_select(0, meta.read_slots), meta.conv_windows, meta.conv_keep
    )
    first = 0
    for i, slot in enumerate(slots):
        chunk = x[first : first + lens[i]]
        full = torch.cat([history[slot], chunk])  # every input so far, oldest first
        conv = F.conv1d(full.t()[None], weight, padding=kernel - 1, groups=channels)
        expected = F.silu(conv[0, :, : full.shape[0]].t())[-lens[i] :]
        assert torch.allclose(out[first : first + lens[i]], expected, atol=1e-5)
        kept = full[-(kernel - 1) :]
        assert torch.allclose(new_states[i, kernel - 1 - kept.shape[0] :], kept)
        first += lens[i]


def test_rows_verifying_drafts_chain_conv_and_recurrent_state():
    """A decode row of one sequence, then three rows of another carrying on one another (its
    drafts): each chained row sees the rows before it, and writes the state after its own
    token to its own slot, as decoding the tokens one by one would."""
    kernel, channels, heads, key_dim, value_dim = 4, 6, 2, 8, 5
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(channels, 1, kernel, generator=gen)
    starts, lens = np.array([5, 9, 10, 11]), np.ones(4, dtype=np.int64)
    slots, reads = np.array([1, 2, 3, 4]), np.array([1, 2, 2, 3])
    continues = np.array([False, False, True, True])
    meta = build_linear_metadata(starts, lens, slots, kernel, torch.device("cpu"), reads, continues)
    conv_pool = torch.randn(5, kernel - 1, channels, generator=gen)
    x = torch.randn(4, channels, generator=gen)
    out, new_states = causal_conv(
        x, weight, conv_pool.index_select(0, meta.read_slots), meta.conv_windows, meta.conv_keep
    )
    # Reference: slot 2's history, then the chain's three inputs, one at a time.
    history = conv_pool[2]
    for row in (1, 2, 3):
        window = torch.cat([history, x[row : row + 1]])
        expected = F.silu((window * weight.squeeze(1).t()).sum(0))
        assert torch.allclose(out[row], expected, atol=1e-5)
        history = window[1:]
        assert torch.equal(new_states[row], history)
    q, k, v, g, beta, _ = (t[0] for t in _inputs(1, 4, heads, key_dim, value_dim))
    state_pool = torch.randn(5, heads, key_dim, value_dim, generator=gen)
    start_states = state_pool.clone()
    result = delta_rule(q, k, v, g, beta, state_pool, meta)
    state = start_states[2:3]
    for row in (1, 2, 3):
        expected, state = recurrent_gated_delta_step(
            *(t[row : row + 1] for t in (q, k, v, g, beta)), state
        )
        assert torch.allclose(result[row], expected[0], atol=1e-6)
        assert torch.allclose(state_pool[slots[row]], state[0], atol=1e-6)
