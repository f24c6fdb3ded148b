"""Binds a Llama-family, Gemma 3 or Qwen3.5 hybrid model to the native decode step
(native/decode_step.py).

`StepBinding` reads the model once into C structs of raw pointers (weights, norms, rotary
tables, each layer's KV cache). The binding holds pointers, not tensors' lifetimes: the
runner drops it whenever the weights or the KV cache are reallocated or changed
(`ModelRunner._reset_captures`, `commit_weights`), and binds again on the next step.
Dense bf16 weights (a model without quantization, on a CPU with AMX or AVX512-BF16) run as
packed tiles that the binding owns: binding again after a weight update packs the new weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from forklift.model.gemma3 import Gemma3ForCausalLM
from forklift.model.layers.block_weights import BlockInt4, BlockInt8
from forklift.model.layers.lora_weights import LoRASlots
from forklift.model.layers.norm import RMSNorm, ZeroCentredRMSNorm
from forklift.model.llama import LayerCache, LlamaForCausalLM
from forklift.model.model_config import ModelConfig
from forklift.model.mtp_layer import MultiTokenPredictor
from forklift.model.qwen3_5 import Qwen3_5ForCausalLM
from forklift.native.decode_attention_kernel import CACHE_FORMATS
from forklift.native.decode_step import (
    LAYER_ATTENTION,
    LAYER_LINEAR,
    StepLayer,
    StepLinearLayer,
    StepLinearShape,
    StepLoRA,
    StepModel,
    StepQuantWeight,
)
from forklift.native.dense_weights import pack_dense_all, packed_shape

_DTYPE_FLAGS = {torch.bfloat16: 1, torch.float32: 0}
# The native step runs every step whole, at any number of rows, unless an engine opts out of
# one forward (batch_invariant off): then block weights run decode steps of up to this many
# rows beside dense copies for prefill, twice what the PyTorch layers' block kernels take
# (with no Python between layers the step still pays at 17-32 rows), and dense bf16 weights
# (AMX tiles or AVX512-BF16 dot products) decode steps of up to DENSE_STEP_MAX_ROWS (an RL
# rollout's 8 prompts x 8 samples; chosen against oneDNN on AMX), prefill chunks then taking
# oneDNN's GEMM on the same weights.
SPLIT_STEP_MAX_ROWS = 32
DENSE_STEP_MAX_ROWS = 64


def _pointer(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError("the native decode step needs contiguous tensors")
    return tensor.data_ptr()


def _quant_weight(weight: object) -> StepQuantWeight:
    if isinstance(weight, DenseTiles):
        return StepQuantWeight(weight.packed.data_ptr(), None, None, weight.n, weight.k, 0, 1)
    if isinstance(weight, BlockInt4):
        return StepQuantWeight(weight.codes.data_ptr(), weight.scales.data_ptr(),
                            weight.mins.data_ptr(), *weight.shape, weight.precise)  # fmt: skip
    assert isinstance(weight, BlockInt8)
    return StepQuantWeight(weight.codes.data_ptr(), weight.scales.data_ptr(), None, *weight.shape,
                        weight.precise)  # fmt: skip


def _lora(linear: nn.Module) -> StepLoRA:
    slots: LoRASlots | None = getattr(linear, "lora", None)
    if slots is None:
        return StepLoRA()
    return StepLoRA(
        _pointer(slots.a), _pointer(slots.b), _pointer(slots.ranks),
        _pointer(slots.slice_starts_tensor), len(slots.slice_sizes), slots.max_rank,
    )  # fmt: skip


def _head_weight(model: LlamaForCausalLM) -> object:
    return model.quantized_head if model.lm_head is None else model.lm_head.quantized


@dataclass(frozen=True)
class DenseTiles:
    """A dense bf16 weight [n, k] packed as AMX tiles (`pack_dense`), which the AVX512-BF16
    dot products read too."""

    packed: torch.Tensor
    n: int
    k: int


def dense_linears(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Every projection's weight and the LM head's by name ("0.qkv" .. "head"), where all of
    them are dense bf16 (no quantized copy); else None."""
    weights = {}
    for index, layer in enumerate(model.layers):
        for name, linear in zip(_PROJECTIONS, _layer_linears(layer), strict=True):
            if linear.quantized is not None:
                return None
            weights[f"{index}.{name}"] = linear.weight
    if _head_weight(model) is not None:
        return None
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    weights["head"] = head
    return weights if all(w.dtype == torch.bfloat16 for w in weights.values()) else None


_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The native model classes: a hybrid's linear layers run csrc/gated_deltanet.h.
_NATIVE_MODELS = (LlamaForCausalLM, Gemma3ForCausalLM, Qwen3_5ForCausalLM)


def _is_linear_layer(layer: nn.Module) -> bool:
    return hasattr(layer, "linear_attn")


def _layer_linears(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """A layer's four projections in the step's order: the mixer's input and output (q/k/v
    and o, or a linear layer's in_proj and out_proj), then the MLP's."""
    if _is_linear_layer(layer):
        first, out = layer.linear_attn.in_proj, layer.linear_attn.out_proj
    else:
        first, out = layer.self_attn.qkv_proj, layer.self_attn.o_proj
    return first, out, layer.mlp.gate_up_proj, layer.mlp.down_proj


def dense_tile_bytes(model: nn.Module) -> int:
    """Bytes of the packed tiles a binding holds for this model's dense weights (0: none)."""
    weights = dense_linears(model)
    if weights is None:
        return 0
    return sum(2 * math.prod(packed_shape(*w.shape)) for w in weights.values())


def unsupported_reason(model: nn.Module, dense_tiles: bool = False) -> str | None:
    """Why this model cannot run the native step (None: it can). `dense_tiles`: the step
    library runs dense bf16 weights on this CPU (AMX or AVX512-BF16), so they qualify too."""
    if type(model) not in _NATIVE_MODELS:
        return f"{type(model).__name__} is not a Llama-family, Gemma 3 or Qwen3.5 model"
    if model.tp is not None:
        return "tensor parallelism"
    if model.embed_tokens.weight.dtype not in _DTYPE_FLAGS:
        return f"dtype {model.embed_tokens.weight.dtype}"
    if model.config.rotary_dim % 2:
        return "an odd rotary dimension"
    blocks = (BlockInt4, BlockInt8)
    dense = dense_tiles and dense_linears(model) is not None
    dtype = model.embed_tokens.weight.dtype
    for layer in model.layers:
        if not dense and not all(
            isinstance(lin.quantized, blocks) for lin in _layer_linears(layer)
        ):
            return (
                "layers without native block weights (quantization none, or decode_backend "
                "torch), nor dense bf16 ones on a CPU with AMX or AVX512-BF16"
            )
        norms = [*_layer_norms(layer), model.norm]
        if _is_linear_layer(layer):
            mixer = layer.linear_attn
            own = (mixer.conv1d_weight, mixer.dt_bias, mixer.A_log, mixer.norm.weight)
            if any(t.dtype != dtype for t in own):
                return "linear layers' tensors in another dtype than the model's"
        else:
            norms += [n for n in (layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None]
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
        attention = config.attention_layers  # (a hybrid's linear layers hold states)
        key_cache = layer_caches[attention[0]][0]
        kv_heads, num_blocks, block_size = key_cache.shape[:3]
        head_dim = config.head_dim
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
        self.max_rows: int | None = None  # any: the backend picks the steps it runs

        def weight(quantized: object, name: str) -> StepQuantWeight:
            return _quant_weight(quantized if dense is None else self._dense[name])

        layers = []
        caches = zip(model.layers, layer_caches, strict=True)
        for index, (layer, (keys, values)) in enumerate(caches):
            if _is_linear_layer(layer):
                layers.append(self._linear_layer(model, index, keys, values, weight))
                continue
            rope = local_rope if getattr(layer, "is_sliding", False) else global_rope
            layers.append(_attention_layer(
                layer, index, (keys, values), dtype, rope, weight, gemma,
                config.attention_output_gate,
            ))  # fmt: skip
        self._layers = (StepLayer * len(layers))(*layers)
        # A dropped embedding is looked up in the tied head's int8 blocks.
        embed, embed_blocks = _pointer(model.embed_tokens.weight), StepQuantWeight()
        if model.embed_tokens.weight.is_meta:
            embed, embed_blocks = None, _quant_weight(model.quantized_head)
        self.num_groups = 1 + max(layer.group for layer in layers)
        self.model = StepModel(
            config.num_layers, config.hidden_size, config.num_heads, kv_heads, head_dim,
            config.intermediate_size, config.vocab_size, config.rotary_dim, num_blocks,
            block_size, config.rms_norm_eps, model.layers[attention[0]].self_attn.scale,
            _DTYPE_FLAGS[dtype], embed, _pointer(model.norm.weight),
            weight(_head_weight(model), "head"), self._layers,
            _NORM_OFFSETS[type(model.norm)], config.embedding_multiplier if gemma else 0.0,
            int(config.mlp_activation == "gelu_tanh"), embed_blocks,
            CACHE_FORMATS[key_cache.dtype], _linear_shape(config),
        )  # fmt: skip

    @property
    def global_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-attention layers' rotary tables (cos, sin), float32."""
        return self._ropes[0]

    @property
    def head_tiles(self) -> DenseTiles | None:
        """The LM head's packed dense tiles, which the step's sampled rows go through; None
        on block weights."""
        return self._dense.get("head")

    @staticmethod
    def _linear_layer(
        model: LlamaForCausalLM,
        index: int,
        conv_states: torch.Tensor,
        recurrent_states: torch.Tensor,
        weight: Callable[[object, str], StepQuantWeight],
    ) -> StepLayer:
        """A Gated DeltaNet layer: its projections in the attention's places, its state
        slots in place of the KV cache."""
        layer = model.layers[index]
        mixer, mlp = layer.linear_attn, layer.mlp
        if conv_states.dtype != model.embed_tokens.weight.dtype:
            raise ValueError("the native step needs the convolution states in the model's dtype")
        return StepLayer(
            input_norm=_pointer(layer.input_layernorm.weight),
            post_norm=_pointer(layer.post_attention_layernorm.weight),
            qkv=weight(mixer.in_proj.quantized, f"{index}.qkv"),
            o=weight(mixer.out_proj.quantized, f"{index}.o"),
            gate_up=weight(mlp.gate_up_proj.quantized, f"{index}.gate_up"),
            down=weight(mlp.down_proj.quantized, f"{index}.down"),
            lora_qkv=_lora(mixer.in_proj),
            lora_o=_lora(mixer.out_proj),
            lora_gate_up=_lora(mlp.gate_up_proj),
            lora_down=_lora(mlp.down_proj),
            kind=LAYER_LINEAR,
            linear=StepLinearLayer(
                _pointer(mixer.conv1d_weight),
                _pointer(mixer.dt_bias),
                _pointer(mixer.A_log),
                _pointer(mixer.norm.weight),
                _pointer(conv_states),
                _pointer(recurrent_states),
            ),  # fmt: skip
        )


def _attention_layer(
    layer: nn.Module,
    index: int,
    cache: LayerCache,
    dtype: torch.dtype,
    rope: tuple[torch.Tensor, torch.Tensor],
    weight: Callable[[object, str], StepQuantWeight],
    gemma: bool,
    output_gate: bool,
) -> StepLayer:
    """An attention decoder layer: its norms, projections (named "<index>.qkv" ...), KV
    cache, rotary table and LoRA slots."""
    attn, mlp = layer.self_attn, layer.mlp
    keys, values = cache
    if keys.dtype not in CACHE_FORMATS or values.dtype != keys.dtype:
        raise ValueError("the native decode step needs the KV cache in bf16, fp32 or coded")
    # Gemma: post_attention_layernorm norms attention's output, and the MLP's input norm is
    # pre_feedforward_layernorm; Llama's post_attention_layernorm is the latter.
    pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    cos, sin = rope
    return StepLayer(
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
        *(_lora(lin) for lin in _layer_linears(layer)),
        LAYER_ATTENTION,
        int(output_gate),
    )  # fmt: skip


class MtpStepBinding:
    """Qwen3.5's MTP layer as a one-layer step on dense bf16 tiles: the target's embedding
    and head (its binding's structs, so its packed head serves both), then the layer's
    input projection over the normed embedding and hidden state, its decoder layer on its
    own KV cache, and its norm. The target's binding must outlive this one."""

    def __init__(
        self,
        mtp: MultiTokenPredictor,
        target: StepBinding,
        cache: LayerCache,
        dense_buffer: torch.Tensor | None = None,
    ) -> None:
        """`dense_buffer`: an earlier MTP binding's, packed into again (the target binds
        again after each weight update; the layer's own weights stay)."""
        if not target.model.head.dense:
            raise ValueError("the MTP layer's native step runs beside a dense bf16 target")
        layer = mtp.layers[0]
        dtype = mtp.fc.weight.dtype
        dense = {"fc": mtp.fc.weight} | {
            f"0.{name}": linear.weight
            for name, linear in zip(_PROJECTIONS, _layer_linears(layer), strict=True)
        }
        if any(w.dtype != torch.bfloat16 for w in dense.values()):
            raise ValueError("the MTP layer's native step needs its weights in bf16")
        packs, self.dense_buffer = pack_dense_all(list(dense.values()), dense_buffer)
        self._dense = {name: DenseTiles(p, *w.shape)
                       for (name, w), p in zip(dense.items(), packs, strict=True)}  # fmt: skip
        self._target = target
        # The target's fp32 tables: the layer's own were cast to the model's dtype.
        self._rope = target.global_rope

        def weight(_: object, name: str) -> StepQuantWeight:
            return _quant_weight(self._dense[name])

        config = mtp.layer_config
        keys = cache[0]
        kv_heads, num_blocks, block_size = keys.shape[:3]
        self._layers = (StepLayer * 1)(
            _attention_layer(layer, 0, cache, dtype, self._rope, weight, False,
                             config.attention_output_gate)
        )  # fmt: skip
        self.vocab = target.vocab
        self.hidden = target.hidden
        self.max_rows: int | None = None  # any: a long prompt's catch-up too
        self.num_groups = 1
        outer = target.model
        self.model = StepModel(
            1, config.hidden_size, config.num_heads, kv_heads, config.head_dim,
            config.intermediate_size, config.vocab_size, config.rotary_dim, num_blocks,
            block_size, config.rms_norm_eps, layer.self_attn.scale, _DTYPE_FLAGS[dtype],
            outer.embed, _pointer(mtp.norm.weight), outer.head, self._layers,
            _NORM_OFFSETS[type(mtp.norm)], 0.0, outer.gelu, outer.embed_blocks,
            CACHE_FORMATS[keys.dtype], StepLinearShape(), weight(None, "fc"),
            _pointer(mtp.pre_fc_norm_embedding.weight), _pointer(mtp.pre_fc_norm_hidden.weight),
        )  # fmt: skip

    @property
    def target(self) -> StepBinding:
        return self._target


def _linear_shape(config: ModelConfig) -> StepLinearShape:
    shape = config.linear_attention
    if shape is None or not config.is_hybrid:
        return StepLinearShape()
    return StepLinearShape(
        shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim,
        shape.conv_kernel,
    )  # fmt: skip


# Most rows of one attention task, and rows a step computes at a time (csrc/decode_step.c's
# PIECE_MAX_ROWS and STEP_CHUNK_ROWS).
_PIECE_MAX_ROWS = 32
_STEP_CHUNK_ROWS = 256
# Positions of one attention chunk (csrc/paged_attention_avx512.h's ATTENTION_CHUNK).
_ATTENTION_CHUNK = 1024


def native_step_peak_bytes(
    config: ModelConfig,
    rows: int,
    sampled_rows: int,
    max_context: int,
    block_size: int,
    num_groups: int,
    dense: bool = False,
) -> int:
    """What a native step of `rows` tokens holds at its peak beyond weights and cache: a
    chunk's activations and int8 rows (csrc/decode_step.c runs STEP_CHUNK_ROWS at a time;
    `dense`: also its rows rounded to bf16 for the dense tiles),
    every thread's attention scores (over the whole context where the tiled kernel does not
    run), the per-token block tables and masks the runner builds and every row's final
    hidden state (prompt logprobs), and the logits of `sampled_rows` with the sampler's
    sorted copies of them."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    gate = 2 if config.attention_output_gate else 1
    # The first projection's rows, the mixer's scratch and output (csrc/decode_step.c).
    projection, mixed, values, linear_scratch = gate * q_size + 2 * kv_size, q_size, q_size, 0
    chunk = min(rows, _STEP_CHUNK_ROWS)
    linear = config.linear_attention if config.is_hybrid else None
    if linear is not None:
        channels = linear.conv_channels
        projection = max(projection, channels + linear.value_size + 2 * linear.num_value_heads)
        mixed, values = max(q_size, channels), max(q_size, linear.value_size)
        # csrc/gated_deltanet.h's scratch: a head's state and vectors per thread, and two ints
        # per row for the chains (the convolution's outputs are `mixed`).
        dk, dv = linear.key_head_dim, linear.value_head_dim
        linear_scratch = 4 * (os.cpu_count() or 1) * (dk * dv + 2 * (dk + dv)) + 16 * chunk
    widest = max(hidden, inter, q_size, values)
    activations = 4 * (chunk * (2 * hidden + projection + mixed + values + 3 * inter) + widest)
    activations += linear_scratch
    int8_rows = 2 * chunk * (widest + 12 * widest // 32 + 32)
    # csrc/dense_matmul.h's dense_scratch_elements, bf16
    bf16_rows = 2 * (-(-chunk // 16) * 16) * (-(-widest // 32) * 32) if dense else 0
    group = config.num_heads // config.num_kv_heads
    scores = 4 * _PIECE_MAX_ROWS * group * max_context * (os.cpu_count() or 1)
    chunks = -(-max_context // _ATTENTION_CHUNK)
    parts = 4 * chunk * config.num_heads * chunks * (head_dim + 2) if chunks > 1 else 0
    width = -(-max_context // block_size)
    tables = num_groups * rows * width * (8 + 4 * block_size) + 4 * rows * hidden
    logits = 3 * 4 * min(sampled_rows, rows) * config.vocab_size
    return activations + int8_rows + bf16_rows + scores + parts + tables + logits
