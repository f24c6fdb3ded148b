"""A whole decode step in one native call (csrc/decode_step.c), for the Llama family.

`NativeDecodeStep.bind` reads the model once into C structs of raw pointers (weights,
norms, rotary tables, each layer's KV cache); a step then passes only its index tensors.
The binding holds pointers, not tensors' lifetimes: the runner drops it whenever the
weights or the KV cache are reallocated or changed (`ModelRunner._reset_captures`,
`commit_weights`), and binds again on the next step.

What the C side owns: nothing beyond one step (its scratch is allocated and freed per
call). What it writes: each row's new K and V into the cache slot given, and the logits.
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from forklift.model.layers.norm import RMSNorm
from forklift.model.layers.quantized import BLOCK_MAX_ROWS
from forklift.model.llama import LayerCache, LlamaForCausalLM
from forklift.native.build import load_native_library
from forklift.native.quant_matmul import BlockInt4, BlockInt8

PROFILER_NAME = "forklift::native_decode_step"
_DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}
# Most rows one native step runs (the block kernels' limit); larger decode steps take the
# PyTorch path.
NATIVE_STEP_MAX_ROWS = BLOCK_MAX_ROWS


class _QuantWeight(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("precise", ctypes.c_int32),
    ]


class _StepLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("qkv", _QuantWeight),
        ("o", _QuantWeight),
        ("gate_up", _QuantWeight),
        ("down", _QuantWeight),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
    ]


class _StepModel(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int64) for name in (
            "num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
            "rotary_dim", "num_blocks", "block_size")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("is_bf16", ctypes.c_int),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("head", _QuantWeight),
        ("layers", ctypes.POINTER(_StepLayer)),
    ]  # fmt: skip


def _pointer(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError("the native decode step needs contiguous tensors")
    return tensor.data_ptr()


def _quant_weight(weight: object) -> _QuantWeight:
    if isinstance(weight, BlockInt4):
        return _QuantWeight(weight.codes.data_ptr(), weight.scales.data_ptr(),
                            weight.mins.data_ptr(), *weight.shape, weight.precise)  # fmt: skip
    assert isinstance(weight, BlockInt8)
    return _QuantWeight(weight.codes.data_ptr(), weight.scales.data_ptr(), None, *weight.shape,
                        weight.precise)  # fmt: skip


def _head_weight(model: LlamaForCausalLM) -> object:
    return model.quantized_head if model.lm_head is None else model.lm_head.quantized


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this model cannot run the native step (None: it can)."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a Llama-family model"
    if model.tp is not None:
        return "tensor parallelism"
    if model.embed_tokens.weight.dtype not in _DTYPE_FLAGS:
        return f"dtype {model.embed_tokens.weight.dtype}"
    if model.config.rotary_dim % 2:
        return "an odd rotary dimension"
    blocks = (BlockInt4, BlockInt8)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(lin.quantized, blocks) for lin in linears):
            return (
                "layers without native block weights (quantization none, or decode_backend torch)"
            )
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if not all(type(n) is RMSNorm for n in norms):
            return "norms other than RMSNorm"
    if not isinstance(_head_weight(model), blocks):
        return "an LM head without native block weights"
    if type(model.norm) is not RMSNorm:
        return "a final norm other than RMSNorm"
    return None


class StepBinding:
    """The C structs of one model and KV cache; the tensors they point into must outlive it."""

    def __init__(self, model: LlamaForCausalLM, layer_caches: list[LayerCache]) -> None:
        config = model.config
        key_cache = layer_caches[0][0]
        kv_heads, num_blocks, block_size, head_dim = key_cache.shape
        dtype = model.embed_tokens.weight.dtype
        self.vocab = config.vocab_size
        layers = []
        for layer, (keys, values) in zip(model.layers, layer_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            if keys.dtype != dtype or values.dtype != dtype:
                raise ValueError("the native decode step needs the KV cache in the model's dtype")
            layers.append(_StepLayer(
                _pointer(layer.input_layernorm.weight),
                _pointer(layer.post_attention_layernorm.weight),
                _pointer(attn.q_norm.weight) if attn.q_norm is not None else None,
                _pointer(attn.k_norm.weight) if attn.k_norm is not None else None,
                _pointer(attn.qkv_proj.bias),
                _pointer(attn.o_proj.bias),
                _quant_weight(attn.qkv_proj.quantized),
                _quant_weight(attn.o_proj.quantized),
                _quant_weight(mlp.gate_up_proj.quantized),
                _quant_weight(mlp.down_proj.quantized),
                _pointer(keys),
                _pointer(values),
            ))  # fmt: skip
        self._layers = (_StepLayer * len(layers))(*layers)
        self._rope = (model.rotary.cos.contiguous(), model.rotary.sin.contiguous())
        self.model = _StepModel(
            config.num_layers, config.hidden_size, config.num_heads, kv_heads, head_dim,
            config.intermediate_size, config.vocab_size, config.rotary_dim, num_blocks,
            block_size, config.rms_norm_eps, model.layers[0].self_attn.scale,
            _DTYPE_FLAGS[dtype], _pointer(model.embed_tokens.weight), _pointer(model.norm.weight),
            _pointer(self._rope[0]), _pointer(self._rope[1]), _quant_weight(_head_weight(model)),
            self._layers,
        )  # fmt: skip


@dataclass(frozen=True)
class StepTimings:
    """Seconds native steps spent, summed over the steps timed."""

    matrix: float
    attention: float
    other: float


class NativeDecodeStep:
    """The loaded step library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_decode_step
        function.argtypes = [
            ctypes.POINTER(_StepModel), ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_void_p,
        ]  # fmt: skip
        function.restype = ctypes.c_int
        self._function = function
        self._timings: ctypes.Array[ctypes.c_double] | None = None

    def start_timing(self) -> None:
        """Sum, from now on, the seconds each step spends in matmuls, attention and the rest
        (what `forklift bench profile` reports of a native step)."""
        self._timings = (ctypes.c_double * 3)()

    def stop_timing(self) -> StepTimings:
        timings = self._timings
        self._timings = None
        if timings is None:
            return StepTimings(0.0, 0.0, 0.0)
        return StepTimings(*timings)

    @classmethod
    def load(cls) -> NativeDecodeStep | None:
        library = load_native_library("decode_step")
        return None if library is None else cls(library)

    def __call__(
        self,
        binding: StepBinding,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_blocks: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [rows, vocab] float32 of one decode token per row; K/V written in place."""
        rows = input_ids.shape[0]
        if not 0 < rows <= NATIVE_STEP_MAX_ROWS:
            raise ValueError(f"a native step runs 1-{NATIVE_STEP_MAX_ROWS} rows, got {rows}")
        ids = input_ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        blocks = kv_blocks.to(torch.int64).contiguous()
        bias = bias.reshape(rows, -1).to(torch.float32).contiguous()
        logits = torch.empty(rows, binding.vocab, dtype=torch.float32)
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function(PROFILER_NAME) if profiling else nullcontext():
            failed = self._function(
                ctypes.byref(binding.model), rows, ids.data_ptr(), positions.data_ptr(),
                slots.data_ptr(), blocks.data_ptr(), blocks.shape[1], bias.data_ptr(),
                logits.data_ptr(), torch.get_num_threads(), self._timings,
            )  # fmt: skip
        if failed:
            raise MemoryError("the native decode step could not allocate its scratch buffers")
        return logits
