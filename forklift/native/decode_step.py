"""A whole decode step in one native call (csrc/decode_step.c), for the Llama family and
Gemma 3.

`NativeDecodeStep.bind` reads the model once into C structs of raw pointers (weights,
norms, rotary tables, each layer's KV cache); a step then passes only its index tensors.
The binding holds pointers, not tensors' lifetimes: the runner drops it whenever the
weights or the KV cache are reallocated or changed (`ModelRunner._reset_captures`,
`commit_weights`), and binds again on the next step.

What the C side owns: nothing beyond one step (its scratch is allocated and freed per
call). What it writes: each row's new K and V into the cache slot given, and the logits.
Dense bf16 weights (a model without quantization, on a CPU with AMX) run as packed tiles
that the binding owns: binding again after a weight update packs the new weights.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from forklift.model.gemma3 import Gemma3ForCausalLM
from forklift.model.layers.lora_slots import LoRASlots
from forklift.model.layers.norm import RMSNorm, ZeroCentredRMSNorm
from forklift.model.llama import LayerCache, LlamaForCausalLM
from forklift.model.model_config import ModelConfig
from forklift.native.build import load_native_library
from forklift.native.dense_weights import pack_dense_all, packed_shape
from forklift.native.quant_matmul import BlockInt4, BlockInt8

PROFILER_NAME = "forklift::native_decode_step"
_DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}
# Block weights run every step whole, at any number of rows, unless an engine keeps dense
# copies for prefill (batch_invariant off): then decode steps of up to this many rows, twice
# what the PyTorch layers' block kernels take (with no Python between layers the step still
# pays at 17-32 rows). Most rows of a step on dense bf16 weights (AMX tiles), which run
# decode steps only (prefill chunks take oneDNN's GEMM on the same weights): an RL rollout's
# 8 prompts x 8 samples in one step.
SPLIT_STEP_MAX_ROWS = 32
DENSE_STEP_MAX_ROWS = 64


class _QuantWeight(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("precise", ctypes.c_int32),
        ("dense", ctypes.c_int32),
    ]


class _StepLoRA(ctypes.Structure):
    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("ranks", ctypes.c_void_p),
        ("slice_starts", ctypes.c_void_p),
        ("slices", ctypes.c_int64),
        ("max_rank", ctypes.c_int64),
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
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("group", ctypes.c_int64),
        ("lora_qkv", _StepLoRA),
        ("lora_o", _StepLoRA),
        ("lora_gate_up", _StepLoRA),
        ("lora_down", _StepLoRA),
    ]


class _StepGroup(ctypes.Structure):
    _fields_ = [
        ("slots", ctypes.c_void_p),
        ("blocks", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
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
        ("head", _QuantWeight),
        ("layers", ctypes.POINTER(_StepLayer)),
        ("norm_offset", ctypes.c_float),
        ("embed_scale", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("embed_blocks", _QuantWeight),
    ]  # fmt: skip


def _pointer(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError("the native decode step needs contiguous tensors")
    return tensor.data_ptr()


def _quant_weight(weight: object) -> _QuantWeight:
    if isinstance(weight, DenseTiles):
        return _QuantWeight(weight.packed.data_ptr(), None, None, weight.n, weight.k, 0, 1)
    if isinstance(weight, BlockInt4):
        return _QuantWeight(weight.codes.data_ptr(), weight.scales.data_ptr(),
                            weight.mins.data_ptr(), *weight.shape, weight.precise)  # fmt: skip
    assert isinstance(weight, BlockInt8)
    return _QuantWeight(weight.codes.data_ptr(), weight.scales.data_ptr(), None, *weight.shape,
                        weight.precise)  # fmt: skip


def _lora(linear: nn.Module) -> _StepLoRA:
    slots: LoRASlots | None = getattr(linear, "lora", None)
    if slots is None:
        return _StepLoRA()
    return _StepLoRA(
        _pointer(slots.a), _pointer(slots.b), _pointer(slots.ranks),
        _pointer(slots.slice_starts_tensor), len(slots.slice_sizes), slots.max_rank,
    )  # fmt: skip


def _head_weight(model: LlamaForCausalLM) -> object:
    return model.quantized_head if model.lm_head is None else model.lm_head.quantized


@dataclass(frozen=True)
class DenseTiles:
    """A dense bf16 weight [n, k] packed for the AMX tiles (`pack_dense`)."""

    packed: torch.Tensor
    n: int
    k: int


def dense_linears(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Every projection's weight and the LM head's by name ("0.qkv" .. "head"), where all of
    them are dense bf16 (no quantized copy); else None."""
    weights = {}
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, linear in zip(_PROJECTIONS, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                               mlp.down_proj), strict=True):  # fmt: skip
            if linear.quantized is not None:
                return None
            weights[f"{index}.{name}"] = linear.weight
    if _head_weight(model) is not None:
        return None
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    weights["head"] = head
    return weights if all(w.dtype == torch.bfloat16 for w in weights.values()) else None


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def dense_tile_bytes(model: nn.Module) -> int:
    """Bytes of the packed tiles a binding holds for this model's dense weights (0: none)."""
    weights = dense_linears(model)
    if weights is None:
        return 0
    return sum(2 * math.prod(packed_shape(*w.shape)) for w in weights.values())


def unsupported_reason(model: nn.Module, dense_tiles: bool = False) -> str | None:
    """Why this model cannot run the native step (None: it can). `dense_tiles`: the step
    library runs dense bf16 weights on this CPU (AMX), so they qualify too."""
    if type(model) not in (LlamaForCausalLM, Gemma3ForCausalLM):
        return f"{type(model).__name__} is neither a Llama-family nor a Gemma 3 model"
    if model.tp is not None:
        return "tensor parallelism"
    if model.embed_tokens.weight.dtype not in _DTYPE_FLAGS:
        return f"dtype {model.embed_tokens.weight.dtype}"
    if model.config.rotary_dim % 2:
        return "an odd rotary dimension"
    blocks = (BlockInt4, BlockInt8)
    dense = dense_tiles and dense_linears(model) is not None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not dense and not all(isinstance(lin.quantized, blocks) for lin in linears):
            return (
                "layers without native block weights (quantization none, or decode_backend "
                "torch), nor dense bf16 ones on a CPU with AMX"
            )
        norms = [*_layer_norms(layer), model.norm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if len({type(n) for n in norms}) != 1 or type(norms[0]) not in _NORM_OFFSETS:
            return "norms other than RMSNorm (or, throughout, the 1 + w kind)"
    if not dense and not isinstance(_head_weight(model), blocks):
        return "an LM head without native block weights"
    return None


# The native norm scales by offset + w: RMSNorm's w, Gemma's (zero-centred) 1 + w.
_NORM_OFFSETS = MappingProxyType({RMSNorm: 0.0, ZeroCentredRMSNorm: 1.0})


def _layer_norms(layer: nn.Module) -> list[nn.Module]:
    """A layer's norms: before attention, before the MLP and (Gemma) after each."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")  # fmt: skip
    return [getattr(layer, name) for name in names if hasattr(layer, name)]


class StepBinding:
    """The C structs of one model and KV cache; the tensors they point into must outlive it."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        layer_caches: list[LayerCache],
        dense_buffer: torch.Tensor | None = None,
    ) -> None:
        """`dense_buffer`: an earlier binding's `dense_buffer`, packed into again (the runner
        passes it on across weight updates)."""
        config = model.config
        key_cache = layer_caches[0][0]
        kv_heads, num_blocks, block_size, head_dim = key_cache.shape
        dtype = model.embed_tokens.weight.dtype
        self.vocab = config.vocab_size
        self.hidden = config.hidden_size
        gemma = isinstance(model, Gemma3ForCausalLM)
        global_rope = (model.rotary.cos.contiguous(), model.rotary.sin.contiguous())
        local_rope = (
            (model.local_rotary.cos.contiguous(), model.local_rotary.sin.contiguous())
            if gemma else global_rope
        )  # fmt: skip
        self._ropes = (global_rope, local_rope)
        # Dense bf16 weights run as packed tiles, which this binding owns, by name.
        dense = dense_linears(model)
        self.dense_buffer: torch.Tensor | None = None
        self._dense: dict[str, DenseTiles] = {}
        if dense is not None:
            packs, self.dense_buffer = pack_dense_all(list(dense.values()), dense_buffer)
            self._dense = {name: DenseTiles(p, *w.shape)
                           for (name, w), p in zip(dense.items(), packs, strict=True)}  # fmt: skip
        self.max_rows: int | None = None if dense is None else DENSE_STEP_MAX_ROWS

        def weight(quantized: object, name: str) -> _QuantWeight:
            return _quant_weight(quantized if dense is None else self._dense[name])

        layers = []
        caches = zip(model.layers, layer_caches, strict=True)
        for index, (layer, (keys, values)) in enumerate(caches):
            attn, mlp = layer.self_attn, layer.mlp
            if keys.dtype != dtype or values.dtype != dtype:
                raise ValueError("the native decode step needs the KV cache in the model's dtype")
            # Gemma: post_attention_layernorm norms attention's output, and the MLP's input
            # norm is pre_feedforward_layernorm; Llama's post_attention_layernorm is the latter.
            pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
            cos, sin = local_rope if getattr(layer, "is_sliding", False) else global_rope
            layers.append(_StepLayer(
                _pointer(layer.input_layernorm.weight),
                _pointer(pre_mlp.weight),
                _pointer(attn.q_norm.weight) if attn.q_norm is not None else None,
                _pointer(attn.k_norm.weight) if attn.k_norm is not None else None,
                _pointer(attn.qkv_proj.bias),
                _pointer(attn.o_proj.bias),
                weight(attn.qkv_proj.quantized, f"{index}.qkv"),
                weight(attn.o_proj.quantized, f"{index}.o"),
                weight(mlp.gate_up_proj.quantized, f"{index}.gate_up"),
                weight(mlp.down_proj.quantized, f"{index}.down"),
                _pointer(keys),
                _pointer(values),
                _pointer(layer.post_attention_layernorm.weight) if gemma else None,
                _pointer(layer.post_feedforward_layernorm.weight) if gemma else None,
                _pointer(cos),
                _pointer(sin),
                getattr(layer, "kv_group", 0),
                *(_lora(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                         mlp.down_proj)),
            ))  # fmt: skip
        self._layers = (_StepLayer * len(layers))(*layers)
        # A dropped embedding is looked up in the tied head's int8 blocks.
        embed, embed_blocks = _pointer(model.embed_tokens.weight), _QuantWeight()
        if model.embed_tokens.weight.is_meta:
            embed, embed_blocks = None, _quant_weight(model.quantized_head)
        self.num_groups = 1 + max(layer.group for layer in layers)
        self.model = _StepModel(
            config.num_layers, config.hidden_size, config.num_heads, kv_heads, head_dim,
            config.intermediate_size, config.vocab_size, config.rotary_dim, num_blocks,
            block_size, config.rms_norm_eps, model.layers[0].self_attn.scale,
            _DTYPE_FLAGS[dtype], embed, _pointer(model.norm.weight),
            weight(_head_weight(model), "head"), self._layers,
            _NORM_OFFSETS[type(model.norm)], config.embedding_multiplier if gemma else 0.0,
            int(config.mlp_activation == "gelu_tanh"), embed_blocks,
        )  # fmt: skip


# Most rows of one attention task, and rows a step computes at a time (csrc/decode_step.c's
# PIECE_MAX_ROWS and STEP_CHUNK_ROWS).
_PIECE_MAX_ROWS = 32
_STEP_CHUNK_ROWS = 256
# Positions of one attention chunk (csrc/attention_tiles.h's ATTENTION_CHUNK).
_ATTENTION_CHUNK = 1024


def native_step_peak_bytes(
    config: ModelConfig,
    rows: int,
    sampled_rows: int,
    max_context: int,
    block_size: int,
    num_groups: int,
) -> int:
    """What a native step of `rows` tokens holds at its peak beyond weights and cache: a
    chunk's activations and int8 rows (csrc/decode_step.c runs STEP_CHUNK_ROWS at a time),
    every thread's attention scores (over the whole context where the tiled kernel does not
    run), the per-token block tables and masks the runner builds and every row's final
    hidden state (prompt logprobs), and the logits of `sampled_rows` with the sampler's
    sorted copies of them."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    widest = max(hidden, inter, q_size)
    chunk = min(rows, _STEP_CHUNK_ROWS)
    activations = 4 * (chunk * (2 * hidden + q_size + 2 * kv_size + q_size + 3 * inter) + widest)
    int8_rows = 2 * chunk * (widest + 12 * widest // 32 + 32)
    group = config.num_heads // config.num_kv_heads
    scores = 4 * _PIECE_MAX_ROWS * group * max_context * (os.cpu_count() or 1)
    chunks = -(-max_context // _ATTENTION_CHUNK)
    parts = 4 * chunk * config.num_heads * chunks * (head_dim + 2) if chunks > 1 else 0
    width = -(-max_context // block_size)
    tables = num_groups * rows * width * (8 + 4 * block_size) + 4 * rows * hidden
    logits = 3 * 4 * min(sampled_rows, rows) * config.vocab_size
    return activations + int8_rows + scores + parts + tables + logits


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
            ctypes.POINTER(_StepGroup), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ]  # fmt: skip
        function.restype = ctypes.c_int
        self._function = function
        self._library = library
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

    @functools.cached_property
    def dense_tiles(self) -> bool:
        """Whether dense bf16 weights run here: AMX tiles compiled in and granted (asked on
        first use: the request is a system call)."""
        return bool(self._library.forklift_decode_step_dense_tiles())

    @classmethod
    def load(cls) -> NativeDecodeStep | None:
        library = load_native_library("decode_step")
        return None if library is None else cls(library)

    def __call__(
        self,
        binding: StepBinding,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        row_lora: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
        keep_hidden: bool = False,
    ) -> StepOutput:
        """One token per row (a decode row, or one token of a prompt chunk); K/V written in
        place. `groups`: each KV group's (slot mapping, key blocks, mask bias) of the step;
        `row_lora`: each row's LoRA slot (-1: none), or None when no row runs an adapter;
        `logit_rows`: the rows whose logits are wanted, ascending (None: every row);
        `keep_hidden`: also return every row's final normed hidden state."""
        rows = input_ids.shape[0]
        limit = binding.max_rows
        if rows <= 0 or (limit is not None and rows > limit):
            raise ValueError(f"this native step runs 1-{limit or 'any'} rows, got {rows}")
        if len(groups) < binding.num_groups:
            raise ValueError(f"the model reads {binding.num_groups} KV groups, got {len(groups)}")
        ids = input_ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        kept = []  # the tensors the C structs point into, alive through the call
        structs = []
        for slot_mapping, kv_blocks, bias in groups:
            slots = slot_mapping.to(torch.int64).contiguous()
            blocks = kv_blocks.to(torch.int64).contiguous()
            bias = bias.reshape(rows, -1).to(torch.float32).contiguous()
            kept += [slots, blocks, bias]
            structs.append(_StepGroup(slots.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                                      bias.data_ptr()))  # fmt: skip
        group_array = (_StepGroup * len(structs))(*structs)
        lora_rows = None
        if row_lora is not None:
            lora_rows = row_lora.to(torch.int64).contiguous()
            kept.append(lora_rows)
        if logit_rows is None:
            logit_rows = torch.arange(rows, dtype=torch.int64)
        logit_rows = logit_rows.to(torch.int64).contiguous()
        if logit_rows.numel() and (
            int(logit_rows[0]) < 0 or int(logit_rows[-1]) >= rows
            or bool((logit_rows[1:] <= logit_rows[:-1]).any())
        ):  # fmt: skip
            raise ValueError("logit_rows must be ascending rows of the step")
        logits = torch.empty(logit_rows.numel(), binding.vocab, dtype=torch.float32)
        hidden = torch.empty(rows, binding.hidden, dtype=torch.float32) if keep_hidden else None
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function(PROFILER_NAME) if profiling else nullcontext():
            failed = self._function(
                ctypes.byref(binding.model), rows, ids.data_ptr(), positions.data_ptr(),
                group_array, logits.data_ptr(), torch.get_num_threads(), self._timings,
                None if lora_rows is None else lora_rows.data_ptr(), logit_rows.data_ptr(),
                logit_rows.numel(), None if hidden is None else hidden.data_ptr(),
            )  # fmt: skip
        if failed == 2:
            raise RuntimeError("dense bf16 weights bound to a step library without AMX tiles")
        if failed:
            raise MemoryError("the native decode step could not allocate its scratch buffers")
        return StepOutput(logits, hidden)


@dataclass(frozen=True)
class StepOutput:
    """A native step's results: logits of the rows asked for; every row's final normed
    hidden state where asked."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
