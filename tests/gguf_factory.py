"""Write tiny GGUF files from HF state dicts, laid out the way llama.cpp's converter does."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from forklift.checkpoint.gguf_file import _PlainArrayReader
from forklift.model.model_config import ModelConfig

_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    match = _LAYER_NAME.fullmatch(hf_name)
    if match is None or match.group(2) not in _LAYER_PARTS:
        raise ValueError(f"no GGUF name for {hf_name}")
    index, part, kind = match.groups()
    return f"blk.{index}.{_LAYER_PARTS[part]}.{kind}"


def _hf_config_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "config"):  # a transformers model
        hf_config = hf_config.config
    return hf_config.to_dict()


def permute_rotary(array: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's q/k row permutation (HF half-split rotary -> interleaved pairs)."""
    rows = array.shape[0]
    grouped = array.reshape(n_head, 2, rows // n_head // 2, *array.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(array.shape)


def _write_metadata(writer: gguf.GGUFWriter, config: ModelConfig, vocab_size: bool) -> None:
    arch = config.architecture
    writer.add_uint32(f"{arch}.block_count", config.num_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_kv_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    if config.head_dim != config.hidden_size // config.num_heads:
        writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", config.head_dim)
    if vocab_size:
        writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    if config.sliding_window:
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    if config.rope_scaling:
        _write_rope_scaling(writer, arch, config.rope_scaling)
    if config.bos_token_id is not None:
        writer.add_uint32("tokenizer.ggml.bos_token_id", config.bos_token_id)
    if config.eos_token_ids:
        writer.add_uint32("tokenizer.ggml.eos_token_id", config.eos_token_ids[0])


def _write_rope_scaling(writer: gguf.GGUFWriter, arch: str, scaling: Mapping[str, Any]) -> None:
    writer.add_string(f"{arch}.rope.scaling.type", scaling.get("rope_type", scaling.get("type")))
    if "factor" in scaling:
        writer.add_float32(f"{arch}.rope.scaling.factor", float(scaling["factor"]))
    if "original_max_position_embeddings" in scaling:
        original = int(scaling["original_max_position_embeddings"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)


def _write_raw_metadata(writer: gguf.GGUFWriter, metadata: Mapping[str, Any]) -> None:
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))


def _encode(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    """The data to store and the raw dtype to declare.

    F32/F16 stay typed numpy arrays whose dtype the writer reads; other types become raw bytes.
    """
    native = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    return gguf.quants.quantize(array, qtype), None if native else qtype


def write_gguf(
    path: Path,
    hf_config: Any,
    state_dict: Mapping[str, torch.Tensor],
    qtype: str = "F32",
    tokenizer: Mapping[str, Any] | None = None,
    *,
    write_vocab_size: bool = True,
    raw_blocks: Mapping[str, tuple[np.ndarray, str]] | None = None,
) -> Path:
    """Write `state_dict` (HF names and layouts) as a GGUF file at `path`.

    `hf_config` is an HF config dict, a transformers config or a model. Matrices are stored as
    `qtype` (any name in `gguf.GGMLQuantizationType`); 1-D tensors stay F32 like the converter
    keeps them. `tokenizer` maps full GGUF metadata keys (e.g. "tokenizer.ggml.tokens") to values.
    `raw_blocks` maps HF names to (block bytes [N, bytes per row], block type) stored as they
    are in place of the state dict's tensor (for types gguf-py cannot quantize, e.g. Q4_K).
    """
    config = ModelConfig.from_hf_config(_hf_config_dict(hf_config))
    matrix_type = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), config.architecture)
    _write_metadata(writer, config, write_vocab_size)
    _write_raw_metadata(writer, tokenizer or {})
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if raw_blocks and name in raw_blocks:
            blocks, block_type = raw_blocks[name]
            raw_type = gguf.GGMLQuantizationType[block_type]
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=raw_type)
            continue
        array = tensor.detach().to(torch.float32).cpu().numpy()
        array = _converter_layout(name, array, config)
        kind = matrix_type if array.ndim > 1 else gguf.GGMLQuantizationType.F32
        data, raw_dtype = _encode(array, kind)
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _converter_layout(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    if config.architecture not in ("llama", "mistral"):
        return array
    if ".self_attn.q_proj." in name:
        return permute_rotary(array, config.num_heads)
    if ".self_attn.k_proj." in name:
        return permute_rotary(array, config.num_kv_heads)
    return array


@contextlib.contextmanager
def fast_gguf_reader() -> Iterator[None]:
    """transformers parses a GGUF file through gguf.GGUFReader, whose np.memmap slicing takes
    ~20 s over a 262k-token vocabulary; forklift's plain-array reader yields the same values
    in a third of the time. For loading transformers' references from a file."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _PlainArrayReader)
        yield
