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
from dataclasses import dataclass

import torch

from forklift.checkpoint.tensors import Part, canonical_name, find
from forklift.model.model_config import ModelConfig


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
        """This rank's slice of a full HF tensor (a view where it can be); how each tensor
        splits is in the checkpoint's table (checkpoint/tensors.py)."""
        found = find(canonical_name(hf_name))
        split = None if found is None else found[0].split
        if split is None:
            return tensor  # norms: replicated
        if split.part is Part.VOCAB:
            rows = tensor[self.vocab[0] : min(self.vocab[1], config.vocab_size)]
            missing = (self.vocab[1] - self.vocab[0]) - rows.shape[0]
            if missing:
                rows = torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])
            return rows
        start, end = self._range(split.part, config.head_dim)
        return tensor.narrow(split.axis, start, end - start)

    def _range(self, part: Part, head_dim: int) -> tuple[int, int]:
        """[start, end) of this rank's part, in rows (or columns) of a tensor."""
        if part is Part.Q_HEADS:
            return self.q_heads[0] * head_dim, self.q_heads[1] * head_dim
        if part is Part.KV_HEADS:
            return self.kv_heads[0] * head_dim, self.kv_heads[1] * head_dim
        return self.intermediate  # Part.INTERMEDIATE


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
