"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

The forward takes `[num_tokens]` ids from every scheduled sequence at once, with no padding;
attention reaches each sequence's context through the paged KV cache. q/k/v and gate/up
projections are fused into single matmuls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forklift.checkpoint.tensors import canonical_name, is_layer_name, is_unused
from forklift.model.layers.attention import AttentionMetadata, paged_attention, write_kv
from forklift.model.layers.decode_attention import DecodeKernel, gathered_decode_attention
from forklift.model.layers.linear import Linear, pack_weight, packed_linear
from forklift.model.layers.norm import RMSNorm, ZeroCentredRMSNorm
from forklift.model.layers.quantized import QuantizedWeight, quantized_linear
from forklift.model.layers.rotary import RotaryEmbedding, apply_rotary
from forklift.model.model_config import ModelConfig
from forklift.model.tensor_parallel import TensorParallelShard
from forklift.model.weight_slots import expected_hf_names, is_ignored_hf_name, weight_slot

if TYPE_CHECKING:
    from forklift.model.tp_group import TensorParallelGroup

logger = logging.getLogger("forklift")

# One layer's two cache tensors: key and value pages (attention) or conv and recurrent
# state slots (a hybrid's linear layers).
LayerCache = tuple[torch.Tensor, torch.Tensor]


def rms_norm(config: ModelConfig, size: int) -> nn.Module:
    """The model family's RMS norm: scaled by w, or by 1 + w (Qwen3.5)."""
    if config.zero_centred_norms:
        return ZeroCentredRMSNorm(size, config.rms_norm_eps)
    return RMSNorm(size, config.rms_norm_eps)


class Attention(nn.Module):
    """The projections and norms of full attention; with an output gate (Qwen3.5), q_proj
    also yields the gate values, and the forward is the hybrid layer's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.attention_multiplier or self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, config.q_proj_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = rms_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = rms_norm(config, self.head_dim) if config.qk_norm else None


class MLP(nn.Module):
    """Gated MLP: down(act(gate) * up), act SiLU or (Gemma) tanh-approximated GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gelu = config.mlp_activation == "gelu_tanh"
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        active = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(active * up)


class DecoderLayer(nn.Module):
    # The tensor-parallel group the row-parallel projections reduce over (None: one rank).
    tp: TensorParallelGroup | None = None
    # The decode attention kernel (the runner gives a CPU the in-place one).
    decode_attention: DecodeKernel = staticmethod(gathered_decode_attention)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(config, config.hidden_size)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = rms_norm(config, config.hidden_size)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: LayerCache,
        meta: AttentionMetadata,
        regions: LayerRegions,
    ) -> torch.Tensor:
        q, k, v = regions.attention_input(self, hidden, *rope)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        attn = paged_attention(
            q, key_cache, value_cache, meta, self.self_attn.scale, self.decode_attention
        )
        return regions.attention_output_and_mlp(self, hidden, attn)


def attention_input(
    layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused qkv projection, q/k norms and rotary: everything before the KV write."""
    attn = layer.self_attn
    qkv = attn.qkv_proj(layer.input_layernorm(hidden))
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(-1, attn.num_heads, attn.head_dim)
    k = k.view(-1, attn.num_kv_heads, attn.head_dim)
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v


def attention_output_and_mlp(
    layer: DecoderLayer, hidden: torch.Tensor, attn: torch.Tensor
) -> torch.Tensor:
    """Output projection, residual, norm and MLP: everything after attention."""
    hidden = hidden + reduce_partial_sums(layer.tp, layer.self_attn.o_proj(attn))
    return hidden + reduce_partial_sums(layer.tp, layer.mlp(layer.post_attention_layernorm(hidden)))


def reduce_partial_sums(tp: TensorParallelGroup | None, partial: torch.Tensor) -> torch.Tensor:
    """Row-parallel layers give each rank a partial sum; add them up across ranks."""
    return partial if tp is None else tp.all_reduce(partial)


@dataclass(frozen=True)
class LayerRegions:
    """The two dense regions of a decoder layer, plain or compiled; the KV write and paged
    attention between them always run eagerly (compiling the in-place cache write makes
    torch.compile copy the cache)."""

    attention_input: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attention_output_and_mlp: Callable[..., torch.Tensor]


EAGER_REGIONS = LayerRegions(attention_input, attention_output_and_mlp)


def compiled_regions() -> LayerRegions:
    """Both regions under torch.compile with dynamic shapes: one compilation serves every
    layer (weights are inputs, not constants) and every batch and context size."""
    return LayerRegions(
        torch.compile(attention_input, dynamic=True),
        torch.compile(attention_output_and_mlp, dynamic=True),
    )


class LlamaForCausalLM(nn.Module):
    """With a tensor-parallel `shard`, the modules hold that rank's slices (see
    model/tensor_parallel.py): `config` is then the local shape and `full_config` the
    model's."""

    def __init__(
        self,
        full_config: ModelConfig,
        max_positions: int,
        shard: TensorParallelShard | None = None,
    ) -> None:
        super().__init__()
        self.full_config = full_config
        self.shard = shard
        config = full_config if shard is None else shard.local_config(full_config)
        self.config = config
        self.tp: TensorParallelGroup | None = None
        # A given weight skips the random init: the checkpoint replaces its values.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(self.build_layer(config, i) for i in range(config.num_layers))
        self.norm = rms_norm(config, config.hidden_size)
        self.make_rotary(max_positions)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @staticmethod
    def build_layer(config: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(config)

    def make_rotary(self, max_positions: int) -> None:
        """(Re)build the float32 rotary tables, on the current default device (a model built
        on the meta device holds no values in them)."""
        config = self.full_config
        self.rotary = RotaryEmbedding(
            config.rotary_dim, max_positions, config.rope_theta, config.rope_scaling
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layer_caches: list[LayerCache],
        meta: AttentionMetadata,
        regions: LayerRegions = EAGER_REGIONS,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] for a flat batch of tokens. `layer_caches`
        holds each layer's cache: K and V, or a linear layer's conv and recurrent states."""
        hidden = self._embed(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        for layer, cache in zip(self.layers, layer_caches, strict=True):
            hidden = layer(hidden, rope, cache, meta, regions)
        return self.norm(hidden)

    def use_decode_attention(self, kernel: DecodeKernel) -> None:
        for layer in self.layers:
            layer.decode_attention = kernel

    def set_tensor_parallel_group(self, tp: TensorParallelGroup | None) -> None:
        self.tp = tp
        for layer in self.layers:
            layer.tp = tp

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens.weight.is_meta:
            # Dropped for the tied head's blocks, which hold the file's embedding exactly.
            head = self.quantized_head
            assert head is not None and hasattr(head, "rows")
            return head.rows(input_ids).to(self.embed_tokens.weight.dtype)
        if self.tp is None or self.shard is None:
            return self.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank embeds the ids in its rows, zeros elsewhere.
        start, end = self.shard.vocab
        local = input_ids - start
        mine = (input_ids >= start) & (input_ids < end)
        hidden = self.embed_tokens(torch.where(mine, local, 0))
        return self.tp.all_reduce(hidden * mine[:, None].to(hidden.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32, only for the rows that sample."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.quantized_head is not None and (
            hidden.shape[0] <= self.quantized_head.max_rows or self.head_blocks_only
        ):
            logits = quantized_linear(hidden, self.quantized_head, None)
        else:
            weight = self.embed_tokens.weight
            logits = packed_linear(hidden, weight, self.packed_tied_head, None)
        if self.tp is not None:
            gathered = self.tp.all_gather_cat(logits, dim=-1)
            logits = gathered[:, : self.full_config.vocab_size]
        return logits.float()

    packed_tied_head: torch.Tensor | None = None
    # The tied head runs its blocks at every row count (no dense copy of it is packed).
    head_blocks_only = False
    # The tied head as int8 rows (set by model/quantize.py); the embedding lookup stays dense.
    quantized_head: QuantizedWeight | None = None

    def pack_weights(self) -> None:
        """(Re)build the packed copies of every linear weight; call after weights change."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None and not self.head_blocks_only:
            self.packed_tied_head = pack_weight(self.embed_tokens.weight)

    def unpack_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.unpack()
        self.packed_tied_head = None
        self.quantized_head = None

    def packed_bytes(self) -> int:
        """Bytes of the derived weight copies: oneDNN-packed and quantized."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        tensors = [m.packed_weight for m in linears]
        tensors.append(self.packed_tied_head)
        packed = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        quantized = [m.quantized for m in linears] + [self.quantized_head]
        return packed + sum(q.nbytes for q in quantized if q is not None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unused = 0
        for hf_name, tensor in weights:
            if is_ignored_hf_name(hf_name, self.config):
                unused += is_unused(hf_name)
                continue
            hf_name = canonical_name(hf_name)
            slot = weight_slot(hf_name, self.config)
            if slot is None and not is_layer_name(hf_name):
                continue  # a model-wide tensor forklift does not know
            if slot is None or slot.param not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if params[slot.param].is_meta:
                loaded.add(slot.key)  # served from its blocks: no dense copy is kept
                continue
            if self.shard is not None:
                tensor = self.shard.shard(hf_name, tensor, self.full_config)
            dest = slot.view(params[slot.param].data)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(slot.key)
        if unused:
            logger.info(
                "ignored %d checkpoint tensors of parts forklift does not run (vision tower, "
                "multi-token prediction)",
                unused,
            )
        self._check_complete(loaded)

    def _check_complete(self, loaded: set[str]) -> None:
        params = dict(self.named_parameters())
        expected = set()
        for hf_name in expected_hf_names(self.config):
            slot = weight_slot(hf_name, self.config)
            # (a parameter left on the meta device is served from the file's blocks)
            if slot is not None and not params[slot.param].is_meta:
                expected.add(slot.key)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
