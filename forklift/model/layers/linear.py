"""A linear layer that can run from a weight prepacked for oneDNN on a CPU.

MKL's fp32 GEMM is slow for the few rows of a decode step; oneDNN with a weight reordered
once into its blocked layout is 1.3-4x faster there (measured for this project's shapes at
1-32 rows; `forklift bench decode` shows the effect). bf16 weights gain as much on CPUs with
bf16 units (a decode step's linears: 14 vs 28 ms at one row on AVX512-BF16); elsewhere bf16
stays unpacked, since such CPUs should not run bf16. The packed copy is derived data: it is
rebuilt by `pack()` whenever the weight changes, and the plain weight stays the parameter
that loading and `update_weights` write to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forklift.cpu import cpu_has_fast_bf16
from forklift.model.layers.lora_weights import LoRASlots
from forklift.model.layers.quantized import QuantizedWeight, quantized_linear


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and cpu_has_fast_bf16())
        )
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-blocked copy of a [out, in] weight, or None where it does not apply."""
    if not can_pack(weight) or weight.numel() == 0:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


@torch.library.custom_op("forklift::onednn_linear", mutates_args=())
def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The packed matmul as an opaque op, so torch.compile calls it instead of trying (and
    failing) to lower oneDNN's blocked weight itself."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    if packed is not None and x.dim() == 2 and not torch.is_grad_enabled():
        if torch.compiler.is_compiling():
            return onednn_linear(x, weight, packed, bias)
        # Eager calls skip the custom-op wrapper: it costs tens of microseconds a call.
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear plus an optional packed weight used in inference, an optional quantized
    copy used for steps of few rows (decode), where reading fewer weight bytes wins, and
    optional LoRA slots whose adapters add to the rows that use them."""

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    quantized_source: str | None = None  # "gguf blocks" or "round-to-nearest"
    lora: LoRASlots | None = None

    def reset_parameters(self) -> None:
        """Nothing: every weight comes from the checkpoint, so random values would be wasted
        work at start-up (a second on the default model)."""

    def pack(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def unpack(self) -> None:
        self.packed_weight = None
        self.quantized = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = self.quantized
        # Without a dense weight (dropped: see model/quantize.py) the blocks take every step.
        if (
            quantized is not None
            and x.dim() == 2
            and (x.shape[0] <= quantized.max_rows or self.weight.is_meta)
        ):
            out = quantized_linear(x, quantized, self.bias)
        else:
            out = packed_linear(x, self.weight, self.packed_weight, self.bias)
        return out if self.lora is None else self.lora.add_delta(x, out)
