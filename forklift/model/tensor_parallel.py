"""Tensor-parallel sharding: which slice of each Hugging Face tensor one rank holds.

Attention is split by KV-head groups (each rank owns whole GQA groups: its KV heads and the
query heads that read them), the MLP by intermediate columns, the embedding and LM head by
vocabulary rows. When N does not divide a count, the first ranks take one more (SmolLM2's
3 KV heads on 2 ranks: 2 and 1); the vocabulary is padded to a multiple of N instead, so the
gathered logits line up, and the padding is cut off after the gather. Norms are replicated.

Column-parallel layers (qkv, gate/up, embedding, LM head) slice output rows; row-parallel
layers (o_proj, down_proj) slice input columns and their partial sums are all-reduced.

A hybrid's Gated DeltaNet layers split by key heads, each rank owning whole groups: its key
heads and the value heads that read them (as vLLM splits them). Its slice of the fused q/k/v
projection and of the convolution is three ranges (its queries, keys and values), of the
gate, decay and beta projections its value heads; out_proj is row-parallel. Each rank keeps
the recurrent and convolution states of its own heads, so the state slots split too.
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
    # A hybrid's Gated DeltaNet heads: key heads and the value heads they serve.
    linear_key_heads: tuple[int, int] = (0, 0)
    linear_value_heads: tuple[int, int] = (0, 0)

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, world_size: int) -> TensorParallelShard:
        check_tensor_parallel_size(config, world_size)
        group = config.num_heads // config.num_kv_heads
        kv = split_range(config.num_kv_heads, world_size, rank)
        per_rank_vocab = -(-config.vocab_size // world_size)
        linear_keys = linear_values = (0, 0)
        if config.linear_attention is not None:
            shape = config.linear_attention
            served = shape.num_value_heads // shape.num_key_heads
            linear_keys = split_range(shape.num_key_heads, world_size, rank)
            linear_values = (linear_keys[0] * served, linear_keys[1] * served)
        return cls(
            rank=rank,
            world_size=world_size,
            kv_heads=kv,
            q_heads=(kv[0] * group, kv[1] * group),
            intermediate=split_range(config.intermediate_size, world_size, rank),
            vocab=(rank * per_rank_vocab, (rank + 1) * per_rank_vocab),
            linear_key_heads=linear_keys,
            linear_value_heads=linear_values,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank's model is built with."""
        linear = config.linear_attention
        if linear is not None:
            linear = dataclasses.replace(
                linear,
                num_key_heads=self.linear_key_heads[1] - self.linear_key_heads[0],
                num_value_heads=self.linear_value_heads[1] - self.linear_value_heads[0],
            )
        return dataclasses.replace(
            config,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
            linear_attention=linear,
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
        if split.part is Part.FIRST_RANK:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        ranges = self._ranges(split.part, tensor.shape[split.axis], config)
        pieces = [tensor.narrow(split.axis, start, end - start) for start, end in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, split.axis)

    def _ranges(self, part: Part, length: int, config: ModelConfig) -> list[tuple[int, int]]:
        """This rank's [start, end) ranges of a tensor's `length` rows (or columns)."""
        if part is Part.Q_HEADS:  # a head's rows: head_dim, or twice that with output gates
            return [_head_range(self.q_heads, length // config.num_heads)]
        if part is Part.KV_HEADS:
            return [_head_range(self.kv_heads, length // config.num_kv_heads)]
        if part is Part.INTERMEDIATE:
            return [self.intermediate]
        linear = config.linear_attention
        assert linear is not None
        values = _head_range(self.linear_value_heads, linear.value_head_dim)
        if part is Part.LINEAR_VALUE:
            return [values]
        if part is Part.LINEAR_VALUE_HEADS:
            return [self.linear_value_heads]
        keys = _head_range(self.linear_key_heads, linear.key_head_dim)
        key_size = linear.key_size  # LINEAR_QKV: queries, keys, then values
        return [keys, (key_size + keys[0], key_size + keys[1]),
                (2 * key_size + values[0], 2 * key_size + values[1])]  # fmt: skip


def _head_range(heads: tuple[int, int], per_head: int) -> tuple[int, int]:
    return heads[0] * per_head, heads[1] * per_head


def check_tensor_parallel_size(config: ModelConfig, world_size: int) -> None:
    """EngineConfig has already checked that world_size is a positive integer."""
    linear = config.linear_attention
    if linear is not None and world_size > linear.num_key_heads:
        raise ValueError(
            f"tensor_parallel_size={world_size} exceeds the model's {linear.num_key_heads} "
            "linear-attention key heads: each rank must own at least one (with its value heads)"
        )
    if world_size > config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={world_size} exceeds the model's {config.num_kv_heads} KV "
            "heads: each rank must own at least one KV head (with its query heads)"
        )
