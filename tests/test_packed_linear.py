"""The oneDNN-prepacked linear path: same numbers as F.linear, rebuilt when weights change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forklift.model.layers.linear import Linear, can_pack


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN linear on this build")
def test_packed_linear_matches_f_linear_and_follows_repacking():
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True)
    layer.pack()
    assert layer.packed_weight is not None
    for rows in (1, 8, 33):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    x = torch.randn(4, 96)
    with torch.inference_mode():
        stale = layer(x)
        layer.pack()
        fresh = layer(x)
    expected = F.linear(x, layer.weight, layer.bias)
    assert not torch.allclose(stale, expected)  # the packed copy is derived data...
    torch.testing.assert_close(fresh, expected)  # ...rebuilt by pack()
    # With gradients on (training), the plain weight is used.
    y = layer(x.requires_grad_())
    y.sum().backward()
    assert layer.weight.grad is not None


def test_non_float32_weights_are_not_packed():
    layer = Linear(8, 8).to(torch.bfloat16)
    layer.pack()
    assert layer.packed_weight is None
