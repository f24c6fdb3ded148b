"""Read llama.cpp GGUF files: architecture metadata and (dequantized) weights.

Weights come out under Hugging Face parameter names and shapes, as float32, so the model code
is the same whichever format the checkpoint came in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from forklift.checkpoint.tensors import layer_name
from forklift.model.layers.quantized import GROUP_SIZE, Int4Groups
from forklift.model.model_config import ModelConfig

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

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
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


def _array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    field = reader.get_field(key)
    if field is None or not field.types or field.types[0] != gguf.GGUFValueType.ARRAY:
        return None
    return len(field.data)


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
    if arch in ("qwen35", "qwen3next"):
        # The hybrid family runs from HF directories; its GGUF layout (fused, renamed and
        # re-signed linear-attention tensors) is not mapped yet.
        raise ValueError(
            f"GGUF files of the hybrid {arch!r} architecture are not supported yet; serve the "
            "model's Hugging Face safetensors directory instead"
        )
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; forklift supports llama, mistral, "
            "qwen2 and qwen3"
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
    return ModelConfig(
        architecture=arch,
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_required(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads) if num_kv_heads else num_heads,
        head_dim=int(head_dim) if head_dim else hidden // num_heads,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length") or 2048),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader),
    )


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


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face parameter name."""
    layer = _LAYER_NAME.fullmatch(gguf_name)
    if layer is not None:
        index, part, kind = layer.groups()
        if part in _LAYER_TENSORS:
            return layer_name(int(index), f"{_LAYER_TENSORS[part]}.{kind}")
    else:
        top = _GLOBAL_NAME.fullmatch(gguf_name)
        if top is not None and top.group(1) in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` for every tensor, dequantized and in HF layout."""
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        array = _dequantize(reader, tensor)
        if config.architecture in _PERMUTED_ARCHITECTURES:
            array = _unpermute_rotary(array, tensor.name, config)
        yield name, torch.from_numpy(array)


# Block types that are the int4 kernel's form as they stand: 32 values, a scale and an offset.
_INT4_BLOCKS = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}


def gguf_tensor_types(reader: gguf.GGUFReader) -> dict[str, str]:
    """HF parameter name -> the GGUF block type it is stored in (Q4_1, Q8_0, F32, ...)."""
    return {hf_tensor_name(t.name): t.tensor_type.name for t in reader.tensors}


def iter_gguf_int4_groups(
    reader: gguf.GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, Int4Groups]]:
    """Yield `(hf_name, Int4Groups)` for every Q4_0 / Q4_1 tensor, read from its blocks with no
    dense detour: Q4_1 is d * q + m, i.e. scale d and zero m + 8d; Q4_0 is d * (q - 8)."""
    for tensor in reader.tensors:
        block_bytes = _INT4_BLOCKS.get(tensor.tensor_type)
        if block_bytes is None:
            continue
        groups = _int4_groups(tensor, block_bytes)
        if config.architecture in _PERMUTED_ARCHITECTURES:
            groups = Int4Groups(
                *(
                    torch.from_numpy(_unpermute_rotary(part.numpy(), tensor.name, config))
                    for part in (groups.codes, groups.scales, groups.zeros)
                )
            )
        yield hf_tensor_name(tensor.name), groups


def _int4_groups(tensor: Any, block_bytes: int) -> Int4Groups:
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # ggml order: [K, N]
    blocks = np.asarray(tensor.data).reshape(rows, cols // GROUP_SIZE, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * scales
    else:
        zeros = np.zeros_like(scales)
    nibbles = blocks[..., block_bytes - GROUP_SIZE // 2 :]
    # Element j of a block is the low nibble of byte j for j < 16, the high one of byte j - 16.
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)
    return Int4Groups(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(scales),
        torch.from_numpy(zeros),
    )


def _dequantize(reader: gguf.GGUFReader, tensor: Any) -> np.ndarray:
    qtype = tensor.tensor_type
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name} uses quantization type {qtype.name}, "
            "which forklift cannot dequantize"
        ) from exc
    # ggml lists dimensions fastest-varying first; numpy/HF order is the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        array = array.astype(np.float32, copy=False).reshape(shape)
    except ValueError as exc:
        raise ValueError(f"GGUF tensor {tensor.name} does not fit shape {shape}: {exc}") from exc
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
