"""Tensor-parallel sharding: which slice of each Hugging Face tensor one rank holds.

Attention is split by KV-head groups (each rank owns whole GQA groups: its KV heads and the
query heads that read them), the MLP by intermediate columns, the embedding and LM head by
vocabulary rows. When N does not divide a count, the first ranks take one more (SmolLM2's
3 KV heads on 2 ranks: 2 and 1); the vocabulary is padded to a multiple of N instead, so the
gathered logits line up, and the padding is cut off after the gather. Norms are replicated.

Column-parallel layers (qkv, gate/up, embedding, LM head) slice output rows; row-parallel
layers (o_proj, down_proj) slice input columns and their partial sums are all-reduced.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from forklift.model.model_config import ModelConfig

_LAYER_RE = re.compile(r"model\.layers\.\d+\.(.+)")


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are split as evenly as possible."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int
    world_size: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # may end past vocab_size: padding rows of zeros

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, world_size: int) -> TensorParallelShard:
        check_tensor_parallel_size(config, world_size)
        group = config.num_heads // config.num_kv_heads
        kv = split_range(config.num_kv_heads, world_size, rank)
        per_rank_vocab = -(-config.vocab_size // world_size)
        return cls(
            rank=rank,
            world_size=world_size,
            kv_heads=kv,
            q_heads=(kv[0] * group, kv[1] * group),
            intermediate=split_range(config.intermediate_size, world_size, rank),
            vocab=(rank * per_rank_vocab, (rank + 1) * per_rank_vocab),
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank's model is built with."""
        return dataclasses.replace(
            config,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
        )

    def shard(self, hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's slice of a full HF tensor (a view where it can be)."""
        d = config.head_dim
        match = _LAYER_RE.fullmatch(hf_name)
        rest = match.group(1) if match else hf_name
        module = rest.rsplit(".", 1)[0]
        if module == "self_attn.q_proj":
            return tensor[self.q_heads[0] * d : self.q_heads[1] * d]
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            return tensor[self.kv_heads[0] * d : self.kv_heads[1] * d]
        if module == "self_attn.o_proj":
            return tensor[:, self.q_heads[0] * d : self.q_heads[1] * d]
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return tensor[self.intermediate[0] : self.intermediate[1]]
        if module == "mlp.down_proj":
            return tensor[:, self.intermediate[0] : self.intermediate[1]]
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensor[self.vocab[0] : min(self.vocab[1], config.vocab_size)]
            missing = (self.vocab[1] - self.vocab[0]) - rows.shape[0]
            if missing:
                rows = torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])
            return rows
        return tensor  # norms: replicated


def check_tensor_parallel_size(config: ModelConfig, world_size: int) -> None:
    """EngineConfig has already checked that world_size is a positive integer."""
    if config.is_hybrid and world_size > 1:
        raise ValueError(
            f"tensor_parallel_size={world_size}: hybrid linear-attention models "
            f"({config.architecture}) run on one rank; use data-parallel replicas to scale"
        )
    if world_size > config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={world_size} exceeds the model's {config.num_kv_heads} KV "
            "heads: each rank must own at least one KV head (with its query heads)"
        )


def hf_tensor_shape(hf_name: str, config: ModelConfig) -> tuple[int, ...] | None:
    """The full (unsharded) shape of an HF tensor; None for a name the model does not have."""
    h, d, i, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (v, h)
    if hf_name == "model.norm.weight":
        return (h,)
    match = _LAYER_RE.fullmatch(hf_name)
    if match is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if config.qkv_bias:
        shapes.update({
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
        })  # fmt: skip
    if config.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return shapes.get(match.group(1))
