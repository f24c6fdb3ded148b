"""Read llama.cpp GGUF files: architecture metadata and (dequantized) weights.

Weights come out under Hugging Face parameter names and shapes, as float32, so the model code
is the same whichever format the checkpoint came in.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np
import torch

from forklift.checkpoint.tensors import layer_name
from forklift.model import gguf_blocks, gguf_hybrid
from forklift.model.layers.quantized import Int4Groups, Int8Blocks
from forklift.model.model_config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    LinearAttentionConfig,
    ModelConfig,
)

_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", gguf_hybrid.HYBRID_ARCHITECTURE)
# GGUF architecture -> forklift's name for it, where they differ.
_MODEL_ARCHITECTURES = {gguf_hybrid.HYBRID_ARCHITECTURE: "qwen3_5"}

# Architectures whose q/k rows the llama.cpp converter permutes for its rotary layout.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma 3 names its four norms apart (ffn_norm is the pre-MLP norm, as in Llama, but HF
# calls that one pre_feedforward_layernorm there).
_GEMMA3_LAYER_TENSORS = MappingProxyType(
    {
        **_LAYER_TENSORS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
)
# Zero-centred norms (Gemma 3's, Qwen3.5's) scale by 1 + w; llama.cpp's converter stores
# 1 + w, HF stores w. Not the gated norm of Qwen3.5's linear layers, a plain one.
_PLAIN_NORM_IN_ZERO_CENTRED_MODELS = "linear_attn.norm.weight"
# llama.cpp's constants for Gemma 3 that its files do not carry: every sixth layer is global,
# the local layers' rotary base is 10,000.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62

_HYBRID_LAYER_TENSORS = MappingProxyType({**_LAYER_TENSORS, **gguf_hybrid.LAYER_TENSORS})

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_INDEX = re.compile(r"blk\.(\d+)\.")
_HYBRID_SPECIAL_NAME = re.compile(
    r"blk\.(\d+)\.(" + "|".join(map(re.escape, gguf_hybrid.SPECIAL_LAYER_TENSORS)) + ")"
)
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


def _field(reader: gguf.GGUFReader, key: str) -> Any | None:
    """A scalar or string metadata value, or None when the key is absent."""
    field = reader.get_field(key)
    if field is None or not field.data:
        return None
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array, expected a single value")
    part = field.parts[field.data[0]]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part[0]
    if isinstance(value, np.floating):
        # Metadata floats are float32; their shortest repr gives back e.g. 1e-05, not 9.99e-06.
        return float(str(value))
    return value.item()


def _array_field(reader: gguf.GGUFReader, key: str) -> Any | None:
    field = reader.get_field(key)
    if field is None or not field.types or field.types[0] != gguf.GGUFValueType.ARRAY:
        return None
    return field


def _array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    field = _array_field(reader, key)
    return None if field is None else len(field.data)


def _bool_array(reader: gguf.GGUFReader, key: str) -> list[bool] | None:
    field = _array_field(reader, key)
    return None if field is None else [bool(field.parts[i][0]) for i in field.data]


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks the required key {key}")
    return value


def _tensor_names(reader: gguf.GGUFReader) -> set[str]:
    return {tensor.name for tensor in reader.tensors}


def gguf_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """Build a `ModelConfig` from a GGUF file's metadata and tensor inventory."""
    arch = _required(reader, "general.architecture")
    if arch in gguf_hybrid.MOE_HYBRID_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is a mixture-of-experts hybrid; forklift runs the "
            f"dense hybrid ({gguf_hybrid.HYBRID_ARCHITECTURE!r}) and no expert layers"
        )
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; forklift supports {', '.join(_ARCHITECTURES)}"
        )
    names = _tensor_names(reader)
    if "rope_freqs.weight" in names:
        # Llama 3 style per-frequency rope factors are baked into a tensor, not metadata.
        raise ValueError(
            "GGUF files with per-frequency rope factors (rope_freqs) are not supported"
        )
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    head_dim = _field(reader, f"{arch}.attention.key_length")
    sliding_window = _field(reader, f"{arch}.attention.sliding_window")
    # Multi-token-prediction layers follow the decoder's as extra blocks.
    num_layers = int(_required(reader, f"{arch}.block_count"))
    num_layers -= int(_field(reader, f"{arch}.nextn_predict_layers") or 0)
    head_dim = int(head_dim) if head_dim else hidden // num_heads
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        extra = _gemma3_fields(num_layers, hidden, num_heads, head_dim)
    elif arch == gguf_hybrid.HYBRID_ARCHITECTURE:
        extra = _qwen35_fields(reader, names, num_layers, head_dim)
    return ModelConfig(
        architecture=_MODEL_ARCHITECTURES.get(arch, arch),
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads) if num_kv_heads else num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length") or 2048),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        # (the first block of a hybrid may be a linear-attention one)
        qkv_bias=any(n.endswith(".attn_q.bias") for n in names),
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in names),
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader),
        **extra,
    )


def _gemma3_fields(num_layers: int, hidden: int, num_heads: int, head_dim: int) -> dict[str, Any]:
    """What llama.cpp assumes for every Gemma 3 file. The logit scale is
    query_pre_attn_scalar ** -0.5, which the file does not carry either: head_dim for every
    released size but 27B (62 layers), whose scalar is hidden / heads (llama.cpp keys it the
    same way)."""
    scalar = hidden / num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim
    return {
        "layer_types": tuple(
            SLIDING_ATTENTION if (i + 1) % _GEMMA3_SLIDING_PATTERN else FULL_ATTENTION
            for i in range(num_layers)
        ),
        "local_rope_theta": _GEMMA3_LOCAL_ROPE_THETA,
        "attention_multiplier": scalar**-0.5,
        "embedding_multiplier": hidden**0.5,
        "mlp_activation": "gelu_tanh",
        "sandwich_norms": True,
        "zero_centred_norms": True,
    }


def _qwen35_fields(
    reader: gguf.GGUFReader, names: set[str], num_layers: int, head_dim: int
) -> dict[str, Any]:
    """The hybrid's settings: where its linear layers sit (`recurrent_layers`, else every
    `full_attention_interval`-th layer is full) and their shape (`ssm.*`)."""
    arch = gguf_hybrid.HYBRID_ARCHITECTURE
    recurrent = _bool_array(reader, f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        layer_types = [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:num_layers]]
    else:
        interval = int(_field(reader, f"{arch}.full_attention_interval") or 4)
        layer_types = [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)
        ]
    value_heads = int(_required(reader, f"{arch}.ssm.time_step_rank"))
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count")
    first_full = layer_types.index(FULL_ATTENTION) if FULL_ATTENTION in layer_types else None
    return {
        "layer_types": tuple(layer_types),
        "linear_attention": LinearAttentionConfig(
            num_key_heads=int(_required(reader, f"{arch}.ssm.group_count")),
            num_value_heads=value_heads,
            key_head_dim=int(_required(reader, f"{arch}.ssm.state_size")),
            value_head_dim=int(_required(reader, f"{arch}.ssm.inner_size")) // value_heads,
            conv_kernel=int(_required(reader, f"{arch}.ssm.conv_kernel")),
        ),
        "partial_rotary_factor": int(rotary_dim) / head_dim if rotary_dim else 0.25,
        "attention_output_gate": True,
        "zero_centred_norms": True,
        "o_proj_bias": first_full is not None and f"blk.{first_full}.attn_output.bias" in names,
    }


def _vocab_size(reader: gguf.GGUFReader, arch: str) -> int:
    size = _field(reader, f"{arch}.vocab_size") or _array_length(reader, "tokenizer.ggml.tokens")
    if size:
        return int(size)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # ggml order: [hidden, vocab]
    raise ValueError("GGUF file states no vocabulary size and has no token_embd.weight")


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if not kind or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _eos_token_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    # Chat models often end turns with a dedicated end-of-turn token; stop on it too.
    ids = [
        _field(reader, "tokenizer.ggml.eos_token_id"),
        _field(reader, "tokenizer.ggml.eot_token_id"),
    ]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name to its Hugging Face parameter name."""
    layer = _LAYER_NAME.fullmatch(gguf_name)
    parts = _LAYER_TENSORS
    if arch == "gemma3":
        parts = _GEMMA3_LAYER_TENSORS
    elif arch == _MODEL_ARCHITECTURES[gguf_hybrid.HYBRID_ARCHITECTURE]:
        parts = _HYBRID_LAYER_TENSORS
        special = _HYBRID_SPECIAL_NAME.fullmatch(gguf_name)
        if special is not None:
            index, part = special.groups()
            return layer_name(int(index), gguf_hybrid.SPECIAL_LAYER_TENSORS[part])
    if layer is not None:
        index, part, kind = layer.groups()
        if part in parts:
            return layer_name(int(index), f"{parts[part]}.{kind}")
    else:
        top = _GLOBAL_NAME.fullmatch(gguf_name)
        if top is not None and top.group(1) in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: ModelConfig, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` for every tensor the model reads, dequantized and
    in HF layout; those named in `skip` are left out (not even dequantized)."""
    for tensor, name in _model_tensors(reader, config):
        if name in skip:
            continue
        array = _dequantize(reader, tensor)
        if config.architecture in _PERMUTED_ARCHITECTURES:
            array = _unpermute_rotary(array, tensor.name, config)
        if _stored_as_one_plus_w(name, config):
            array -= 1.0
        if config.linear_attention is not None:
            array = gguf_hybrid.to_hf_layout(array, name, config.linear_attention)
        yield name, torch.from_numpy(array)


def _stored_as_one_plus_w(hf_name: str, config: ModelConfig) -> bool:
    return (
        config.zero_centred_norms
        and hf_name.endswith("norm.weight")
        and not hf_name.endswith(_PLAIN_NORM_IN_ZERO_CENTRED_MODELS)
    )


def gguf_tensor_types(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, str]:
    """HF parameter name -> the GGUF block type it is stored in (Q4_1, Q8_0, F32, ...)."""
    return {name: t.tensor_type.name for t, name in _model_tensors(reader, config)}


def _model_tensors(reader: gguf.GGUFReader, config: ModelConfig) -> Iterator[tuple[Any, str]]:
    """(tensor, HF name) of each tensor the model reads: the blocks past the decoder's layers
    (multi-token prediction) are left out."""
    for tensor in reader.tensors:
        layer = _LAYER_INDEX.match(tensor.name)
        if layer is not None and int(layer.group(1)) >= config.num_layers:
            continue
        yield tensor, hf_tensor_name(tensor.name, config.architecture)


def iter_gguf_int4_groups(
    reader: gguf.GGUFReader, config: ModelConfig, names: Collection[str] | None = None
) -> Iterator[tuple[str, Int4Groups]]:
    """Yield `(hf_name, Int4Groups)` for every Q4_0 / Q4_1 / Q4_K matrix (of `names`, when
    given), read exactly from its blocks with no dense detour (gguf_blocks.int4_groups)."""
    for tensor, name, shape in _block_matrices(reader, config, gguf_blocks.INT4_TYPES, names):
        groups = gguf_blocks.int4_groups(tensor.data, tensor.tensor_type, shape)
        parts = (groups.codes, groups.scales, groups.zeros)
        parts = _rows_in_hf_order(parts, tensor.name, name, config)
        if parts is not None:
            yield name, Int4Groups(*parts)


def iter_gguf_int8_blocks(
    reader: gguf.GGUFReader, config: ModelConfig, names: Collection[str] | None = None
) -> Iterator[tuple[str, Int8Blocks]]:
    """Yield `(hf_name, Int8Blocks)` for every matrix (of `names`, when given) whose block
    type has an int8 form (gguf_blocks.int8_blocks: exact for Q8_0 / Q5_0 / Q4_0)."""
    for tensor, name, shape in _block_matrices(reader, config, gguf_blocks.INT8_TYPES, names):
        blocks = gguf_blocks.int8_blocks(tensor.data, tensor.tensor_type, shape)
        parts = _rows_in_hf_order((blocks.codes, blocks.scales), tensor.name, name, config)
        if parts is not None:
            yield name, Int8Blocks(*parts, exact=blocks.exact)


def _block_matrices(
    reader: gguf.GGUFReader,
    config: ModelConfig,
    types: Collection[str],
    names: Collection[str] | None,
) -> Iterator[tuple[Any, str, tuple[int, int]]]:
    """(tensor, hf name, [N, K]) of the file's matrices stored in one of `types`."""
    for tensor, name in _model_tensors(reader, config):
        if tensor.tensor_type.name not in types or len(tensor.shape) != 2:
            continue
        if names is None or name in names:
            yield tensor, name, (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml: [K, N]


def _rows_in_hf_order(
    parts: tuple[torch.Tensor, ...], gguf_name: str, hf_name: str, config: ModelConfig
) -> tuple[torch.Tensor, ...] | None:
    """A block matrix's per-row parts (codes and their per-group values alike) in HF's
    order; None where the file's order cannot be undone without cutting blocks."""
    if config.architecture in _PERMUTED_ARCHITECTURES:
        return tuple(
            torch.from_numpy(_unpermute_rotary(p.numpy(), gguf_name, config)) for p in parts
        )
    if config.linear_attention is not None:
        return gguf_hybrid.blocks_to_hf_layout(hf_name, parts, config.linear_attention)
    return parts


def _dequantize(reader: gguf.GGUFReader, tensor: Any) -> np.ndarray:
    qtype = tensor.tensor_type
    # ggml lists dimensions fastest-varying first; numpy/HF order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        array = gguf_blocks.dequantize(tensor.data, qtype, shape)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name} uses quantization type {qtype.name}, "
            "which forklift cannot dequantize"
        ) from exc
    except ValueError as exc:
        raise ValueError(f"GGUF tensor {tensor.name} does not fit shape {shape}: {exc}") from exc
    array = array.astype(np.float32, copy=False)
    if np.may_share_memory(array, reader.data):
        array = array.copy()  # detach from the read-only memory map
    return array


def _unpermute_rotary(array: np.ndarray, gguf_name: str, config: ModelConfig) -> np.ndarray:
    """Invert the converter's q/k row permutation.

    llama.cpp rotates adjacent element pairs, HF rotates the two halves of each head; the
    converter therefore reshapes rows as (heads, 2, head_dim // 2) and swaps the middle axes.
    """
    if ".attn_q." in gguf_name:
        n_head = config.num_heads
    elif ".attn_k." in gguf_name:
        n_head = config.num_kv_heads
    else:
        return array
    rows = array.shape[0]
    grouped = array.reshape(n_head, rows // n_head // 2, 2, *array.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(array.shape)
