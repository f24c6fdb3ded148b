"""Which linear layers run quantized, in which form, and from which source.

`quantization` (vLLM's name) is resolved once per engine into a `QuantizationPlan`:
- "gguf": a GGUF file at its own precision: Q4_0 / Q4_1 tensors become int4 groups straight
  from their blocks, Q8_0 tensors int8 rows; other block types stay dense.
- "int4" / "int8": round-to-nearest of the dense weights at load (int4 groups of 32 inputs,
  or int8 with a scale per row); Q4_0 / Q4_1 GGUF tensors still take their exact blocks.
- "none": dense weights in the model's dtype (the HF-parity path).
A quantized layer keeps its dense weight too: prefill chunks run the dense GEMM.

Two kernel families hold the quantized copies. With the native block kernels
(`forklift/native/quant_matmul.py`, the "native" decode backend) weights keep GGUF's 32-value
blocks with fp16 scales, and the LM head is always int8 blocks (0.9-1.1 ms at one row for
the default model's tied head, against 1.8 for oneDNN-packed bf16 and 2.7 for ATen's int8
rows). With PyTorch's kernels (the "torch" backend) int4 is ATen's packed layout and int8
has a scale per row; the tied head then stays dense where its weight is oneDNN-packed bf16
(faster than ATen's int8 rows: 1.8 vs 2.2 ms at one row, 3.8 vs 12.6 ms at 8), elsewhere it
reads int8 rows. The embedding lookup always stays dense.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from forklift.model.layers.linear import Linear
from forklift.model.layers.quantized import (
    GROUP_SIZE,
    Int4Groups,
    PackedInt4,
    PackedInt8,
    QuantizedWeight,
    cat_groups,
    int4_groups_from_dense,
    int4_kernel_available,
)
from forklift.model.llama import LlamaForCausalLM
from forklift.model.model_config import ModelConfig
from forklift.model.weight_slots import expected_hf_names, weight_slot
from forklift.native.quant_matmul import BlockInt4, BlockInt8, QuantMatmulKernel

logger = logging.getLogger("forklift")

# GGUF block types served as int8 rows in "gguf" mode.
_INT8_GGUF_TYPES = frozenset({"Q8_0"})


@dataclass(frozen=True)
class QuantizationPlan:
    """How one engine quantizes; `int4_groups` yields a GGUF file's exact int4 blocks."""

    method: str  # "none", "gguf", "int4" or "int8"
    tensor_types: dict[str, str] = field(default_factory=dict)  # GGUF: hf name -> block type
    int4_groups: Callable[[], Iterable[tuple[str, Int4Groups]]] | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"


NO_QUANTIZATION = QuantizationPlan("none")


def resolve_quantization(
    quantization: str, dtype_asked: str, model_format: str, device: torch.device
) -> str:
    """The method an engine runs (`quantization` is one EngineConfig validated): "auto" serves
    a GGUF file at its own precision on a CPU, but never lowers a precision the user asked for
    (an explicit float32 or float16 stays dense)."""
    if quantization == "none":
        return "none"
    usable = device.type == "cpu" and int4_kernel_available()
    if quantization == "auto":
        explicit_wide = dtype_asked in ("float32", "fp32", "float", "float16", "fp16", "half")
        if model_format != "gguf" or explicit_wide or not usable:
            return "none"
        return "gguf"
    if not usable:
        raise ValueError(
            f"quantization={quantization!r} needs PyTorch's CPU int4/int8 kernels and a CPU "
            f"device; use quantization='none' on {device.type}"
        )
    return quantization


@dataclass(frozen=True)
class QuantizedTensor:
    name: str
    form: str  # "int4" or "int8"
    source: str  # "gguf blocks" or "round-to-nearest"
    nbytes: int


@dataclass
class QuantizationReport:
    method: str
    kernels: str = "torch"  # "native" block kernels or PyTorch's
    tensors: list[QuantizedTensor] = field(default_factory=list)
    dense_bytes: int = 0  # the dense copies quantized layers keep for prefill

    def summary(self) -> str:
        if not self.tensors:
            return f"quantization {self.method}: all weights dense"
        kernels = "native block kernels" if self.kernels == "native" else "PyTorch kernels"
        kinds: dict[tuple[str, str], list[QuantizedTensor]] = {}
        for tensor in self.tensors:
            kinds.setdefault((tensor.form, tensor.source), []).append(tensor)
        parts = [
            f"{len(group)} tensors {form} from {source} ({_mib(sum(t.nbytes for t in group))})"
            for (form, source), group in kinds.items()
        ]
        return (
            f"quantization {self.method} ({kernels}): " + "; ".join(parts)
            + f"; dense copies for prefill {_mib(self.dense_bytes)}"
        )  # fmt: skip


def quantize_model(
    model: LlamaForCausalLM, plan: QuantizationPlan, kernel: QuantMatmulKernel | None = None
) -> QuantizationReport:
    """Give every linear layer (and the tied head) the quantized copy the plan asks for: in
    the native kernel's blocks where `kernel` is given, else in PyTorch's layouts."""
    report = QuantizationReport(plan.method, "native" if kernel is not None else "torch")
    if not plan.enabled:
        return report
    sources = _sources_of(model.config)
    exact = _exact_int4_groups(model, plan, sources)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        param = f"{name}.weight"
        form = _form_for(plan, sources[param])
        dense_head = kernel is None and _is_bf16(module.packed_weight)
        if form is None or (param == "lm_head.weight" and dense_head):
            continue
        precise = _takes_precise_activations(name)
        weight, source = _quantize_weight(module.weight, form, exact.get(param), kernel, precise)
        module.quantized = weight
        report.tensors.append(QuantizedTensor(param, form, source, weight.nbytes))
        logger.debug("quantized %s: %s from %s, %d bytes", param, form, source, weight.nbytes)
        report.dense_bytes += module.weight.numel() * module.weight.element_size()
    if model.lm_head is None and (kernel is not None or not _is_bf16(model.packed_tied_head)):
        model.quantized_head = _int8(model.embed_tokens.weight, kernel, precise=True)
        report.tensors.append(
            QuantizedTensor("lm_head (tied)", "int8", "round-to-nearest",
                            model.quantized_head.nbytes)
        )  # fmt: skip
    return report


def requantize(
    model: LlamaForCausalLM, changed_params: set[str], kernel: QuantMatmulKernel | None = None
) -> None:
    """After a weight update: re-quantize (round-to-nearest) the layers whose weights changed,
    in the form and kernel family they had, so no stale quantized copy outlives its weight."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            if f"{name}.weight" in changed_params:
                form, precise = module.quantized.form, _takes_precise_activations(name)
                module.quantized, _ = _quantize_weight(module.weight, form, None, kernel, precise)
    if model.quantized_head is not None and "embed_tokens.weight" in changed_params:
        model.quantized_head = _int8(model.embed_tokens.weight, kernel, precise=True)


def _takes_precise_activations(module_name: str) -> bool:
    """Native copies whose inputs int8 rounds too coarsely: the LM head (sampling reads its
    logits) and the MLP's down projection, whose input (silu(gate) * up) carries the
    outliers. Teacher-forced perplexity of the tests' text on the default model: 34.40 with
    int8 activations everywhere, 34.12 with the down projection's precise, 34.26 for
    PyTorch's int4 kernels (bf16 activations), 34.37 dense."""
    return module_name == "lm_head" or module_name.endswith("mlp.down_proj")


def _quantize_weight(
    weight: torch.Tensor,
    form: str,
    exact: Int4Groups | None,
    kernel: QuantMatmulKernel | None,
    precise: bool = False,
) -> tuple[QuantizedWeight, str]:
    if form == "int8":
        return _int8(weight, kernel, precise), "round-to-nearest"
    groups = exact if exact is not None else int4_groups_from_dense(weight)
    source = "gguf blocks" if exact is not None else "round-to-nearest"
    if kernel is not None:
        return BlockInt4.from_groups(groups, kernel, precise=precise), source
    return PackedInt4.pack(groups), source


def _int8(
    weight: torch.Tensor, kernel: QuantMatmulKernel | None, precise: bool = False
) -> QuantizedWeight:
    if kernel is not None:
        return BlockInt8.from_dense(weight, kernel, precise=precise)
    return PackedInt8.quantize(weight)


def _form_for(plan: QuantizationPlan, hf_names: list[str]) -> str | None:
    """int4, int8 or None (dense) for a layer fed by these checkpoint tensors."""
    if plan.method == "int8" or (plan.method == "int4" and hf_names != ["lm_head.weight"]):
        return plan.method
    if plan.method == "int4":
        return "int8"  # an untied LM head: 4 bits cost it more accuracy than any other layer
    types = {plan.tensor_types.get(n) for n in hf_names}
    if types <= {"Q4_0", "Q4_1"}:
        return "int4"
    if types <= {"Q4_0", "Q4_1"} | _INT8_GGUF_TYPES:
        return "int8"
    return None


def _sources_of(config: ModelConfig) -> dict[str, list[str]]:
    """Model parameter -> the HF tensors that fill it, in row order (q, k, v; gate, up)."""
    sources: dict[str, list[tuple[int, str]]] = {}
    for hf_name in expected_hf_names(config):
        slot = weight_slot(hf_name, config)
        if slot is not None:
            sources.setdefault(slot.param, []).append((slot.row_offset, hf_name))
    return {param: [n for _, n in sorted(parts)] for param, parts in sources.items()}


def _exact_int4_groups(
    model: LlamaForCausalLM, plan: QuantizationPlan, sources: dict[str, list[str]]
) -> dict[str, Int4Groups]:
    """Model parameter -> its int4 groups from the file, where every part has them."""
    if plan.int4_groups is None or plan.method == "int8":
        return {}
    by_hf: dict[str, Int4Groups] = {}
    for hf_name, groups in plan.int4_groups():
        if model.shard is not None:
            groups = _shard_groups(model, hf_name, groups)
            if groups is None:
                continue
        by_hf[hf_name] = groups
    exact = {}
    for param, hf_names in sources.items():
        if all(n in by_hf for n in hf_names):
            exact[param] = cat_groups([by_hf[n] for n in hf_names])
    return exact


def _shard_groups(model: LlamaForCausalLM, hf_name: str, groups: Int4Groups) -> Int4Groups | None:
    """A tensor-parallel rank's slice of int4 groups; None when the slice cuts a group (the
    layer then falls back to round-to-nearest of its dense shard)."""
    assert model.shard is not None
    config = model.full_config
    n, k = groups.shape
    columns = model.shard.shard(hf_name, torch.arange(k).expand(n, k), config)[0]
    if columns[0] % GROUP_SIZE or columns.numel() % GROUP_SIZE:
        return None
    codes = model.shard.shard(hf_name, groups.codes, config)

    def shard_per_group(values: torch.Tensor) -> torch.Tensor:
        full = values.repeat_interleave(GROUP_SIZE, dim=1)  # [N, K]: one value per input
        return model.shard.shard(hf_name, full, config)[:, ::GROUP_SIZE].contiguous()

    return Int4Groups(codes.contiguous(), shard_per_group(groups.scales),
                      shard_per_group(groups.zeros))  # fmt: skip


def _is_bf16(packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.dtype == torch.bfloat16


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
