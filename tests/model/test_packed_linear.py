"""The oneDNN-prepacked linear path: same numbers as F.linear, rebuilt when weights change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_linear

import forklift.model.layers.linear as linear_module
from forklift.cpu import cpu_flags
from forklift.model.layers.linear import can_pack


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN linear on this build")
def test_packed_linear_matches_f_linear_and_follows_repacking():
    torch.manual_seed(0)
    layer = random_linear(96, 160, bias=True)
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


def test_half_weights_are_never_packed():
    layer = random_linear(8, 8).to(torch.float16)
    layer.pack()
    assert layer.packed_weight is None


def _onednn_reorders_bf16() -> bool:
    """oneDNN's bf16 weight reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT, bf16 units or not."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


@pytest.mark.parametrize(
    "fast_bf16",
    [
        pytest.param(True, marks=pytest.mark.skipif(
            not _onednn_reorders_bf16(), reason="this CPU cannot reorder bf16 weights at all")),
        False,
    ],
)  # fmt: skip
def test_bf16_weights_are_packed_only_on_cpus_with_bf16_units(monkeypatch, fast_bf16):
    monkeypatch.setattr(linear_module, "cpu_has_fast_bf16", lambda: fast_bf16)
    torch.manual_seed(0)
    layer = random_linear(64, 96, bias=False).to(torch.bfloat16)
    layer.pack()
    if not can_pack(torch.zeros(1)):
        assert layer.packed_weight is None
        return
    assert (layer.packed_weight is not None) == fast_bf16
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=2e-2, atol=2e-2)
