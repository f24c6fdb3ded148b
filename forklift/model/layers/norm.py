"""RMS normalisation, computed in float32 like the reference implementation."""

from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class ZeroCentredRMSNorm(torch.nn.Module):
    """Qwen3.5's and Gemma's norm: the weight is stored as w - 1 and the scaling stays in
    float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """Gated DeltaNet's output norm: RMS-normalise each head, scale, multiply by silu(gate)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.weight * rms_normalize(x, self.eps).to(x.dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
