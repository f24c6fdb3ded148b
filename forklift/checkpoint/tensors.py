"""The tensors of a Llama-family Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3, Gemma 3
and the Qwen3.5 hybrid), as one table.

Each row names a tensor, the forklift parameter it fills (a fused parameter takes several
tensors as consecutive blocks of rows), its shape and how tensor parallelism splits it.
Sizes are named, not numbers: the model layer resolves them against a model's config
(model/weight_slots.py). Loading, tensor-parallel sharding and weight updates all read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType


class Dim(Enum):
    """A size a model's config fixes."""

    HIDDEN = "hidden"
    VOCAB = "vocab"
    HEAD = "head_dim"
    Q = "q"  # query heads x head_dim: o_proj's input
    Q_PROJ = "q_proj"  # q_proj's rows: the queries, and as many gate values with an output gate
    KV = "kv"
    INTERMEDIATE = "intermediate"
    # Gated DeltaNet (linear attention) layers.
    CONV_CHANNELS = "conv_channels"
    CONV_KERNEL = "conv_kernel"
    VALUE = "value"  # value heads x value head_dim
    VALUE_HEADS = "value_heads"
    VALUE_HEAD = "value_head_dim"


class Scope(Enum):
    """Where a tensor occurs. The two mixers' values are HF's `layer_types` names."""

    MODEL = "model"  # once per model
    LAYER = "layer"  # in every decoder layer
    FULL_ATTENTION = "full_attention"
    LINEAR_ATTENTION = "linear_attention"


class Needs(Enum):
    """The config setting a tensor exists only with."""

    QKV_BIAS = "qkv_bias"
    O_PROJ_BIAS = "o_proj_bias"
    QK_NORM = "qk_norm"
    UNTIED_HEAD = "untied_head"
    SANDWICH_NORMS = "sandwich_norms"  # norms around the MLP too (Gemma 3)


class Part(Enum):
    """The range of one tensor-parallel rank a split keeps (model/tensor_parallel.py)."""

    Q_HEADS = "q_heads"
    KV_HEADS = "kv_heads"
    INTERMEDIATE = "intermediate"
    VOCAB = "vocab"  # padded to a multiple of the ranks with rows of zeros
    # Gated DeltaNet, split by key heads and the value heads that read them: the fused q/k/v
    # channels (the rank's queries, keys and values), value rows, one entry per value head.
    LINEAR_QKV = "linear_qkv"
    LINEAR_VALUE = "linear_value"
    LINEAR_VALUE_HEADS = "linear_value_heads"
    FIRST_RANK = "first_rank"  # a row-parallel bias: added once, by rank 0 (zeros elsewhere)


@dataclass(frozen=True)
class Split:
    """A rank keeps its `part` of axis `axis`: 0 for column-parallel layers (output rows),
    1 for row-parallel ones (input columns, partial sums all-reduced)."""

    axis: int
    part: Part


@dataclass(frozen=True)
class CheckpointTensor:
    name: str  # the HF name; a layer tensor's is what follows "model.layers.{i}."
    param: str  # forklift's parameter; a layer tensor's is what follows "layers.{i}."
    shape: tuple[Dim | int, ...]
    scope: Scope = Scope.LAYER
    # Rows of a fused parameter, after the parts of these sizes; None: the whole parameter.
    fused_after: tuple[Dim, ...] | None = None
    split: Split | None = None  # None: every rank holds all of it
    needs: Needs | None = None
    # Checkpoints carry it even where the model has none (an HF state dict of tied
    # embeddings still holds lm_head.weight): skipped, not refused, there.
    skipped_without_need: bool = False

    def hf_name(self, layer: int | None) -> str:
        return self.name if layer is None else layer_name(layer, self.name)

    def param_name(self, layer: int | None) -> str:
        return self.param if layer is None else f"layers.{layer}.{self.param}"


_H, _V, _D, _I = Dim.HIDDEN, Dim.VOCAB, Dim.HEAD, Dim.INTERMEDIATE
_Q, _QP, _KV = Dim.Q, Dim.Q_PROJ, Dim.KV
_CONV, _VAL, _VHEADS = Dim.CONV_CHANNELS, Dim.VALUE, Dim.VALUE_HEADS
_ATTN, _LINEAR = Scope.FULL_ATTENTION, Scope.LINEAR_ATTENTION
# Column-parallel layers split output rows, row-parallel ones input columns.
_VOCAB_ROWS = Split(0, Part.VOCAB)
_Q_ROWS = Split(0, Part.Q_HEADS)
_KV_ROWS = Split(0, Part.KV_HEADS)
_I_ROWS = Split(0, Part.INTERMEDIATE)
_Q_COLUMNS = Split(1, Part.Q_HEADS)
_I_COLUMNS = Split(1, Part.INTERMEDIATE)
_QKV_CHANNELS = Split(0, Part.LINEAR_QKV)
_VALUE_ROWS, _VALUE_COLUMNS = Split(0, Part.LINEAR_VALUE), Split(1, Part.LINEAR_VALUE)
_VALUE_HEADS = Split(0, Part.LINEAR_VALUE_HEADS)
_QKV, _QKV_BIAS = "self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"
_IN_PROJ = "linear_attn.in_proj.weight"

TENSORS: tuple[CheckpointTensor, ...] = (
    CheckpointTensor("model.embed_tokens.weight", "embed_tokens.weight", (_V, _H), Scope.MODEL,
                     split=_VOCAB_ROWS),
    CheckpointTensor("model.norm.weight", "norm.weight", (_H,), Scope.MODEL),
    CheckpointTensor("lm_head.weight", "lm_head.weight", (_V, _H), Scope.MODEL,
                     split=_VOCAB_ROWS, needs=Needs.UNTIED_HEAD, skipped_without_need=True),
    # Full attention: q, k and v fused into one projection (with an output gate, q_proj's
    # rows alternate per head between queries and gate values).
    CheckpointTensor("self_attn.q_proj.weight", _QKV, (_QP, _H), _ATTN,
                     fused_after=(), split=_Q_ROWS),
    CheckpointTensor("self_attn.k_proj.weight", _QKV, (_KV, _H), _ATTN,
                     fused_after=(_QP,), split=_KV_ROWS),
    CheckpointTensor("self_attn.v_proj.weight", _QKV, (_KV, _H), _ATTN,
                     fused_after=(_QP, _KV), split=_KV_ROWS),
    CheckpointTensor("self_attn.o_proj.weight", "self_attn.o_proj.weight", (_H, _Q), _ATTN,
                     split=_Q_COLUMNS),
    CheckpointTensor("self_attn.q_proj.bias", _QKV_BIAS, (_QP,), _ATTN,
                     fused_after=(), split=_Q_ROWS, needs=Needs.QKV_BIAS),
    CheckpointTensor("self_attn.k_proj.bias", _QKV_BIAS, (_KV,), _ATTN,
                     fused_after=(_QP,), split=_KV_ROWS, needs=Needs.QKV_BIAS),
    CheckpointTensor("self_attn.v_proj.bias", _QKV_BIAS, (_KV,), _ATTN,
                     fused_after=(_QP, _KV), split=_KV_ROWS, needs=Needs.QKV_BIAS),
    CheckpointTensor("self_attn.o_proj.bias", "self_attn.o_proj.bias", (_H,), _ATTN,
                     split=Split(0, Part.FIRST_RANK), needs=Needs.O_PROJ_BIAS),
    CheckpointTensor("self_attn.q_norm.weight", "self_attn.q_norm.weight", (_D,), _ATTN,
                     needs=Needs.QK_NORM),
    CheckpointTensor("self_attn.k_norm.weight", "self_attn.k_norm.weight", (_D,), _ATTN,
                     needs=Needs.QK_NORM),
    # Gated DeltaNet: its four input projections fused in row order q/k/v, z, b, a.
    CheckpointTensor("linear_attn.in_proj_qkv.weight", _IN_PROJ, (_CONV, _H), _LINEAR,
                     fused_after=(), split=_QKV_CHANNELS),
    CheckpointTensor("linear_attn.in_proj_z.weight", _IN_PROJ, (_VAL, _H), _LINEAR,
                     fused_after=(_CONV,), split=_VALUE_ROWS),
    CheckpointTensor("linear_attn.in_proj_b.weight", _IN_PROJ, (_VHEADS, _H), _LINEAR,
                     fused_after=(_CONV, _VAL), split=_VALUE_HEADS),
    CheckpointTensor("linear_attn.in_proj_a.weight", _IN_PROJ, (_VHEADS, _H), _LINEAR,
                     fused_after=(_CONV, _VAL, _VHEADS), split=_VALUE_HEADS),
    CheckpointTensor("linear_attn.conv1d.weight", "linear_attn.conv1d_weight",
                     (_CONV, 1, Dim.CONV_KERNEL), _LINEAR, split=_QKV_CHANNELS),
    CheckpointTensor("linear_attn.dt_bias", "linear_attn.dt_bias", (_VHEADS,), _LINEAR,
                     split=_VALUE_HEADS),
    CheckpointTensor("linear_attn.A_log", "linear_attn.A_log", (_VHEADS,), _LINEAR,
                     split=_VALUE_HEADS),
    CheckpointTensor("linear_attn.norm.weight", "linear_attn.norm.weight", (Dim.VALUE_HEAD,),
                     _LINEAR),
    CheckpointTensor("linear_attn.out_proj.weight", "linear_attn.out_proj.weight", (_H, _VAL),
                     _LINEAR, split=_VALUE_COLUMNS),
    # Every layer: gate and up fused into one projection.
    CheckpointTensor("mlp.gate_proj.weight", "mlp.gate_up_proj.weight", (_I, _H),
                     fused_after=(), split=_I_ROWS),
    CheckpointTensor("mlp.up_proj.weight", "mlp.gate_up_proj.weight", (_I, _H),
                     fused_after=(_I,), split=_I_ROWS),
    CheckpointTensor("mlp.down_proj.weight", "mlp.down_proj.weight", (_H, _I), split=_I_COLUMNS),
    CheckpointTensor("input_layernorm.weight", "input_layernorm.weight", (_H,)),
    CheckpointTensor("post_attention_layernorm.weight", "post_attention_layernorm.weight", (_H,)),
    CheckpointTensor("pre_feedforward_layernorm.weight", "pre_feedforward_layernorm.weight", (_H,),
                     needs=Needs.SANDWICH_NORMS),
    CheckpointTensor("post_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                     (_H,), needs=Needs.SANDWICH_NORMS),
)  # fmt: skip

_MODEL_TENSORS = MappingProxyType({t.name: t for t in TENSORS if t.scope is Scope.MODEL})
_LAYER_TENSORS = MappingProxyType({t.name: t for t in TENSORS if t.scope is not Scope.MODEL})

_LAYER_PREFIX = "model.layers."
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# A vision-language checkpoint nests its language model one level down.
_LANGUAGE_MODEL_PREFIX = "model.language_model."
# Its vision tower and multi-token-prediction head, which forklift does not run.
_UNUSED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
# Older checkpoints saved rotary inverse frequencies; they are recomputed from the config.
_DERIVED_SUFFIX = "rotary_emb.inv_freq"


def find(hf_name: str) -> tuple[CheckpointTensor, int | None] | None:
    """The row of a canonical HF name and its layer (None: a model-wide tensor); None for a
    name not in the table."""
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is None:
        row = _MODEL_TENSORS.get(hf_name)
        return None if row is None else (row, None)
    row = _LAYER_TENSORS.get(match.group(2))
    return None if row is None else (row, int(match.group(1)))


def layer_name(layer: int, name: str) -> str:
    """The full HF name of decoder layer `layer`'s tensor `name`."""
    return f"{_LAYER_PREFIX}{layer}.{name}"


def is_layer_name(hf_name: str) -> bool:
    """Named as a decoder layer's tensor (whether or not the table has it)."""
    return _LAYER_NAME.fullmatch(hf_name) is not None


def canonical_name(hf_name: str) -> str:
    """The name a text-only checkpoint gives the same tensor."""
    if hf_name.startswith(_LANGUAGE_MODEL_PREFIX):
        return "model." + hf_name.removeprefix(_LANGUAGE_MODEL_PREFIX)
    return hf_name


def is_unused(hf_name: str) -> bool:
    """A tensor of a part forklift does not run (vision tower, multi-token prediction)."""
    return hf_name.startswith(_UNUSED_PREFIXES)


def is_derived(hf_name: str) -> bool:
    """A buffer the model recomputes from its config (never loaded)."""
    return hf_name.endswith(_DERIVED_SUFFIX)
