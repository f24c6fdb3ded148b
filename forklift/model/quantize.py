"""Which linear layers run quantized, in which form, and from which source.

`quantization` (vLLM's name) is resolved once per engine into a `QuantizationPlan`:
- "gguf": a GGUF file at its own precision (forklift/model/gguf_blocks.py decodes the blocks):
  Q4_0 / Q4_1 / Q4_K tensors serve as int4, their groups exactly the file's (the native
  kernels' fp16 scales round Q4_K's, by 2^-11 relative at most); Q8_0, Q5_0, Q5_1, Q5_K and Q6_K
  tensors as int8, and so does a fused layer whose parts mix int4 and int8 types. On the native
  kernels an int8 layer takes the file's blocks as they are where every part is Q8_0, Q5_0 or
  Q4_0 ("gguf blocks"), otherwise a round-to-nearest per 32 inputs of its exactly dequantized
  values; on PyTorch's kernels int8 is a round-to-nearest per row of the dense weight. Other
  types (F32, F16, BF16, Q2_K, Q3_K, the IQ types) stay dense.
- "int4" / "int8": round-to-nearest of the dense weights at load (int4 groups of 32 inputs,
  or int8 with a scale per row); Q4_0 / Q4_1 / Q4_K GGUF tensors still take their exact
  groups, and int8 layers on the native kernels their file's int8 blocks as above.
- "none": dense weights in the model's dtype (the HF-parity path).
Where the native step runs every step on the blocks (forklift/native/decode_step.py), no
dense copy of a block-quantized weight is kept (`drop_dense_copies`); elsewhere a quantized
layer keeps its dense weight too, and prefill chunks run the dense GEMM.

Two kernel families hold the quantized copies. With the native block kernels
(`forklift/native/quant_matmul.py`, the "native" decode backend) weights keep GGUF's
32-value blocks with fp16 scales (`layers/block_weights.py`), and the LM head is always int8
blocks (0.9-1.1 ms at one row for the default model's tied head, against 1.8 for
oneDNN-packed bf16 and 2.7 for ATen's int8 rows). With PyTorch's kernels (the "torch"
backend) int4 is ATen's packed layout and int8 has a scale per row; the tied head then stays
dense where its weight is oneDNN-packed bf16 (faster than ATen's int8 rows: 1.8 vs 2.2 ms at
one row, 3.8 vs 12.6 ms at 8), elsewhere it reads int8 rows. The embedding lookup always
stays dense.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from forklift.model.gguf_blocks import INT4_TYPES, INT8_TYPES
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.model.layers.linear import Linear
from forklift.model.layers.quantized import (
    GROUP_SIZE,
    Int4Groups,
    Int8Blocks,
    PackedInt4,
    PackedInt8,
    QuantizedWeight,
    cat_groups,
    cat_int8_blocks,
    int4_groups_from_dense,
    int4_kernel_available,
)
from forklift.model.llama import LlamaForCausalLM
from forklift.model.model_config import ModelConfig
from forklift.model.weight_slots import expected_hf_names, weight_slot
from forklift.native.quant_matmul import QuantMatmulKernel

logger = logging.getLogger("forklift")

_Blocks = TypeVar("_Blocks", Int4Groups, Int8Blocks)


@dataclass(frozen=True)
class QuantizationPlan:
    """How one engine quantizes. A GGUF file's plan reads the blocks of the tensors it is
    given: `int4_groups` exactly, `int8_blocks` exactly or rounded (`Int8Blocks.exact`)."""

    method: str  # "none", "gguf", "int4" or "int8"
    tensor_types: dict[str, str] = field(default_factory=dict)  # GGUF: hf name -> block type
    int4_groups: Callable[[Collection[str]], Iterable[tuple[str, Int4Groups]]] | None = None
    int8_blocks: Callable[[Collection[str]], Iterable[tuple[str, Int8Blocks]]] | None = None

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
    dense_bytes: int = 0  # the dense copies quantized layers keep for prefill (0: none)

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
        dense = (
            f"dense copies for prefill {_mib(self.dense_bytes)}" if self.dense_bytes
            else "no dense copies (every step runs on the blocks)"
        )  # fmt: skip
        return f"quantization {self.method} ({kernels}): " + "; ".join(parts) + f"; {dense}"


def quantize_from_file(
    model: LlamaForCausalLM, plan: QuantizationPlan, kernel: QuantMatmulKernel
) -> set[str]:
    """Before any weight loads: the native blocks of every linear layer whose checkpoint
    tensors all have blocks in the file, read one layer at a time, their dense weights left
    on the meta device. Returns the checkpoint tensors (HF names) they were made from."""
    if not plan.enabled:
        return set()
    sources = _sources_of(model.config)
    served: set[str] = set()
    for name, module in model.named_modules():
        param = f"{name}.weight"
        if not isinstance(module, Linear) or param not in sources:
            continue
        form = _form_for(plan, sources[param])
        if form is None:
            continue
        blocks = _file_blocks(model, plan, sources, {param: form}, kernel).get(param)
        if blocks is None:
            continue
        precise = _takes_precise_activations(name, form, kernel)
        module.quantized, module.quantized_source = _quantize_weight(
            module.weight, form, blocks, kernel, precise
        )
        _replace_weight(module, None)
        served.update(sources[param])
    return served


def quantize_model(
    model: LlamaForCausalLM, plan: QuantizationPlan, kernel: QuantMatmulKernel | None = None
) -> QuantizationReport:
    """Give every linear layer (and the tied head) the quantized copy the plan asks for: in
    the native kernel's blocks where `kernel` is given, else in PyTorch's layouts. Layers
    `quantize_from_file` already served keep their copies."""
    report = QuantizationReport(plan.method, "native" if kernel is not None else "torch")
    if not plan.enabled:
        return report
    sources = _sources_of(model.config)
    linears = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Linear)}
    forms: dict[str, str | None] = {}
    for param, module in linears.items():
        dense_head = param == "lm_head.weight" and kernel is None and _is_bf16(module.packed_weight)
        forms[param] = None if dense_head else _form_for(plan, sources[param])
    pending = {p: f for p, f in forms.items() if linears[p].quantized is None}
    from_file = _file_blocks(model, plan, sources, pending, kernel)
    for param, module in linears.items():
        form = forms[param]
        if form is None:
            continue
        if module.quantized is not None:  # served from the file's blocks before loading
            weight, source = module.quantized, module.quantized_source or "gguf blocks"
        else:
            precise = _takes_precise_activations(param.removesuffix(".weight"), form, kernel)
            blocks = from_file.get(param)
            weight, source = _quantize_weight(module.weight, form, blocks, kernel, precise)
            module.quantized = weight
        report.tensors.append(QuantizedTensor(param, form, source, weight.nbytes))
        logger.debug("quantized %s: %s from %s, %d bytes", param, form, source, weight.nbytes)
        if not module.weight.is_meta:
            report.dense_bytes += module.weight.numel() * module.weight.element_size()
    if model.lm_head is None and (kernel is not None or not _is_bf16(model.packed_tied_head)):
        blocks = _tied_head_blocks(model, plan, kernel)
        model.quantized_head, source = _quantize_weight(
            model.embed_tokens.weight, "int8", blocks, kernel, precise=True
        )
        report.tensors.append(
            QuantizedTensor("lm_head (tied)", "int8", source, model.quantized_head.nbytes)
        )
    return report


def _tied_head_blocks(
    model: LlamaForCausalLM, plan: QuantizationPlan, kernel: QuantMatmulKernel | None
) -> Int8Blocks | None:
    """A tied head's int8 blocks read from the file's quantized embedding (exact for Q8_0,
    Gemma's): the dense embedding is in the model's dtype, and bf16 cannot hold every
    d * q of a Q8_0 block, so rounding it again would not give the file's codes back."""
    name = "model.embed_tokens.weight"
    if kernel is None or plan.int8_blocks is None or model.shard is not None:
        return None  # (a tensor-parallel rank holds a vocabulary slice of it)
    return next((blocks for _, blocks in plan.int8_blocks({name})), None)


def requantize(
    model: LlamaForCausalLM, changed_params: set[str], kernel: QuantMatmulKernel | None = None
) -> None:
    """After a weight update: re-quantize (round-to-nearest) the layers whose weights changed,
    in the form and kernel family they had, so no stale quantized copy outlives its weight."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            if f"{name}.weight" in changed_params:
                form = module.quantized.form
                precise = _takes_precise_activations(name, form, kernel)
                module.quantized, _ = _quantize_weight(module.weight, form, None, kernel, precise)
    if model.quantized_head is not None and "embed_tokens.weight" in changed_params:
        model.quantized_head = _int8(model.embed_tokens.weight, kernel, precise=True)


def _takes_precise_activations(
    module_name: str, form: str, kernel: QuantMatmulKernel | None
) -> bool:
    """Native copies whose inputs int8 rounds too coarsely for what finer ones cost. The LM
    head always (sampling reads its logits). The MLP's down projection, whose input
    (silu(gate) * up) carries the outliers, where the kernels take a precise row of its
    form as one wide row of codes (every form on the AVX-512 VNNI builds, Q8 on AVX2);
    where it would take two int8 rows (a Q4 weight on AVX2, the plain build) it takes int8,
    as llama.cpp's kernels do. The second row cost 1.14-1.16x a prefill and 1.11-1.13x a
    decode step on AVX2 and bought no perplexity that text long enough to measure it shows:
    the second halves of two 2,048-token held-out windows put both within 0.04% of the
    dense model (mean KL 0.0016 against 0.0020 nats,
    benchmarks/avx2/down-activations-quality.md), while rounding alone moves the tests'
    360-token text by up to 1% (docs/architecture.md, "too short to tell them apart")."""
    if module_name == "lm_head":
        return True
    wide_rows = kernel is not None and kernel.wide_precise(form)
    return wide_rows and module_name.endswith("mlp.down_proj")


def _quantize_weight(
    weight: torch.Tensor,
    form: str,
    from_file: Int4Groups | Int8Blocks | None,
    kernel: QuantMatmulKernel | None,
    precise: bool = False,
) -> tuple[QuantizedWeight, str]:
    """The quantized copy and its source; `from_file` is the layer's file blocks in `form`."""
    if form == "int8":
        if isinstance(from_file, Int8Blocks) and kernel is not None:
            source = "gguf blocks" if from_file.exact else "round-to-nearest"
            return BlockInt8.from_blocks(from_file, kernel, precise), source
        return _int8(weight, kernel, precise), "round-to-nearest"
    exact = from_file if isinstance(from_file, Int4Groups) else None
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
    if types <= INT4_TYPES:
        return "int4"
    if types <= INT4_TYPES | INT8_TYPES:
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


def _file_blocks(
    model: LlamaForCausalLM,
    plan: QuantizationPlan,
    sources: dict[str, list[str]],
    forms: dict[str, str | None],
    kernel: QuantMatmulKernel | None,
) -> dict[str, Int4Groups | Int8Blocks]:
    """Model parameter -> its weight in the file's blocks, where every part has them: int4
    groups for int4 layers, and int8 blocks for int8 layers on the native kernels (PyTorch's
    int8 kernel takes a scale per row, not per block)."""
    found: dict[str, Int4Groups | Int8Blocks] = {}
    if plan.int4_groups is not None:
        params = [p for p, form in forms.items() if form == "int4"]
        found.update(_gather(model, plan.int4_groups, sources, params, _shard_groups, cat_groups))
    if plan.int8_blocks is not None and kernel is not None:
        params = [p for p, form in forms.items() if form == "int8"]
        found.update(
            _gather(model, plan.int8_blocks, sources, params, _shard_int8_blocks, cat_int8_blocks)
        )
    return found


def _gather(
    model: LlamaForCausalLM,
    read: Callable[[Collection[str]], Iterable[tuple[str, _Blocks]]],
    sources: dict[str, list[str]],
    params: list[str],
    shard: Callable[[LlamaForCausalLM, str, _Blocks], _Blocks | None],
    cat: Callable[[list[_Blocks]], _Blocks],
) -> dict[str, _Blocks]:
    """`params` -> their parts' blocks (this rank's slices) stacked, where `read` has all."""
    if not params:
        return {}
    by_hf: dict[str, _Blocks] = {}
    for hf_name, blocks in read({n for p in params for n in sources[p]}):
        sliced = blocks if model.shard is None else shard(model, hf_name, blocks)
        if sliced is not None:
            by_hf[hf_name] = sliced
    return {
        p: cat([by_hf[n] for n in sources[p]])
        for p in params
        if all(n in by_hf for n in sources[p])
    }


def _shard_groups(model: LlamaForCausalLM, hf_name: str, groups: Int4Groups) -> Int4Groups | None:
    """A tensor-parallel rank's slice of int4 groups; None when the slice cuts a group (the
    layer then falls back to round-to-nearest of its dense shard)."""
    parts = _shard_per_group(model, hf_name, groups.codes, (groups.scales, groups.zeros))
    return None if parts is None else Int4Groups(*parts)


def _shard_int8_blocks(
    model: LlamaForCausalLM, hf_name: str, blocks: Int8Blocks
) -> Int8Blocks | None:
    """As `_shard_groups`, for int8 blocks."""
    parts = _shard_per_group(model, hf_name, blocks.codes, (blocks.scales,))
    return None if parts is None else Int8Blocks(*parts, exact=blocks.exact)


def _shard_per_group(
    model: LlamaForCausalLM,
    hf_name: str,
    codes: torch.Tensor,
    per_group: tuple[torch.Tensor, ...],
) -> list[torch.Tensor] | None:
    """This rank's slice of [N, K] codes and of their [N, K / 32] per-group values; None
    when it cuts a group."""
    assert model.shard is not None
    config = model.full_config
    n, k = codes.shape
    columns = model.shard.shard(hf_name, torch.arange(k).expand(n, k), config)[0]
    if columns[0] % GROUP_SIZE or columns.numel() % GROUP_SIZE:
        return None

    def shard_per_group(values: torch.Tensor) -> torch.Tensor:
        full = values.repeat_interleave(GROUP_SIZE, dim=1)  # [N, K]: one value per input
        return model.shard.shard(hf_name, full, config)[:, ::GROUP_SIZE].contiguous()

    sliced = model.shard.shard(hf_name, codes, config).contiguous()
    return [sliced, *(shard_per_group(values) for values in per_group)]


def _is_bf16(packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.dtype == torch.bfloat16


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def drop_dense_copies(model: LlamaForCausalLM, embedding_in_head: bool = False) -> int:
    """Release the dense weight (and its packed copies) of every layer held as native blocks,
    and the tied head's packed copy where the head is blocks; with `embedding_in_head` (the
    tied head holds the file's embedding blocks exactly) the dense embedding too, whose
    lookups then read the head's blocks. A parameter stays, on the meta device, so its shape
    still checks weight updates (`materialize_dense` brings the values back for one).
    Returns the bytes released."""
    released = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.quantized, (BlockInt4, BlockInt8)):
            weight = module.weight
            if not weight.is_meta:
                released += weight.numel() * weight.element_size()
                _replace_weight(module, None)
            if module.packed_weight is not None:
                released += module.packed_weight.numel() * module.packed_weight.element_size()
                module.packed_weight = None
    if model.lm_head is None and isinstance(model.quantized_head, BlockInt8):
        model.head_blocks_only = True
        packed = model.packed_tied_head
        if packed is not None:
            released += packed.numel() * packed.element_size()
            model.packed_tied_head = None
        embedding = model.embed_tokens.weight
        if embedding_in_head and not embedding.is_meta:
            released += embedding.numel() * embedding.element_size()
            _replace_weight(model.embed_tokens, None)
    return released


def materialize_dense(
    model: LlamaForCausalLM, params: Collection[str], kept: Collection[str] = ()
) -> None:
    """Dense room for the dropped weights among `params` (model parameter names) that an
    update is about to write; those in `kept`, whose update writes only some rows (parts of
    a fused weight), get their values back from their blocks for the rows it keeps."""
    modules = dict(model.named_modules())
    embedding = model.embed_tokens.weight
    if "embed_tokens.weight" in params and embedding.is_meta:
        assert isinstance(model.quantized_head, BlockInt8)
        _replace_weight(model.embed_tokens, model.quantized_head.dequantize())
    for param in params:
        module = modules.get(param.removesuffix(".weight"))
        if isinstance(module, Linear) and module.weight.is_meta and module.quantized is not None:
            blocks = module.quantized
            assert isinstance(blocks, (BlockInt4, BlockInt8))
            shape, dtype = module.weight.shape, module.weight.dtype
            # (room only, where the update writes every row)
            values = blocks.dequantize() if param in kept else torch.empty(shape, dtype=dtype)
            _replace_weight(module, values)


def _replace_weight(module: nn.Module, values: torch.Tensor | None) -> None:
    """`module.weight` as a new parameter of the same shape, dtype and grad flag: `values`
    (cast to the dtype), or None for none held (the meta device)."""
    weight = module.weight
    data = (
        torch.empty(weight.shape, dtype=weight.dtype, device="meta") if values is None
        else values.to(weight.dtype)
    )  # fmt: skip
    module.weight = nn.Parameter(data, requires_grad=weight.requires_grad)
