"""The in-place decode attention kernel compiled for a model's shapes when its cache is
allocated, rather than in the first request."""

from __future__ import annotations

import torch

from forklift.model.kv_cache_dtype import is_quantized_cache
from forklift.model.layers.decode_attention import IN_PLACE_MIN_SEQS, DecodeAttention
from forklift.model.llama import LayerCache, LlamaForCausalLM
from forklift.runner.attention_metadata import DECODE_MIN_BLOCKS


def warm_up_decode_attention(
    model: LlamaForCausalLM,
    layer_caches: list[LayerCache],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Compile now; later calls, and later engines in the same process, find it compiled.
    Nothing to do where no step would compile it (a coded cache, the native kernel)."""
    cfg = model.config
    if not cfg.attention_layers:
        return
    layer = cfg.attention_layers[0]
    kernel = model.layers[layer].decode_attention
    if not isinstance(kernel, DecodeAttention) or not kernel.in_place:
        return
    key_cache, value_cache = layer_caches[layer]
    if is_quantized_cache(key_cache):
        return  # an int8 cache's rows are read by gathering (nothing to compile)
    # The native kernel takes queries in either dtype over this cache: the cache stands in.
    if kernel.native is not None and kernel.native.supports(key_cache, key_cache):
        return  # the native kernel serves every decode step: nothing to compile
    seqs, width = IN_PLACE_MIN_SEQS, DECODE_MIN_BLOCKS
    # As in a step: index tensors built outside inference mode, queries inside it (dynamo
    # guards on the difference).
    blocks = torch.zeros(seqs, width, dtype=torch.int64, device=device)
    bias = torch.zeros(seqs, width * block_size, device=device)
    with torch.inference_mode():
        q = torch.zeros(seqs, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        kernel(q, key_cache, value_cache, blocks, bias, 1.0)
