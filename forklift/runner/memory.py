"""How much KV cache fits: the budget arithmetic and peak-memory measurement."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from forklift.core.kv_cache_manager import blocks_per_sequence
from forklift.core.state_checkpoints import CHECKPOINT_BUDGET_SHARE
from forklift.model.kv_cache_dtype import KVCacheFormat, kv_cache_format
from forklift.model.kv_layout import kv_layout
from forklift.model.model_config import ModelConfig

# Recurrent states accumulate over the whole context, so they stay float32 in any model dtype.
RECURRENT_STATE_DTYPE = torch.float32


def kv_bytes_per_token(config: ModelConfig, cache: KVCacheFormat) -> int:
    """K and V, every full-attention layer, every KV head: 2 * L * H_kv * row bytes (d_head
    values, or an int8 cache's d_head codes and scale)."""
    row = cache.row_bytes(config.head_dim)
    return 2 * len(config.attention_layers) * config.num_kv_heads * row


def kv_block_bytes(config: ModelConfig, cache: KVCacheFormat, block_size: int) -> int:
    """One block: `block_size` tokens' K and V in each layer of one KV group."""
    layers = kv_layout(config).layers_per_block
    return 2 * layers * config.num_kv_heads * cache.row_bytes(config.head_dim) * block_size


def state_bytes_per_sequence(config: ModelConfig, dtype: torch.dtype) -> int:
    """A hybrid model's fixed-size state per sequence, over every linear layer: the conv
    history (model dtype) and the recurrent state (float32). 0 for other models."""
    shape = config.linear_attention
    if shape is None:
        return 0
    conv = shape.conv_state_elements() * torch.empty((), dtype=dtype).element_size()
    recurrent = shape.recurrent_state_elements() * RECURRENT_STATE_DTYPE.itemsize
    return len(config.linear_layers) * (conv + recurrent)


def total_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return psutil.virtual_memory().total


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps what small frees leave; dropping a
    model's dense copies frees thousands of them). A no-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers; those on the meta device hold none (a
    dense weight dropped for its blocks)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def measure_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Extra memory `fn` needs at its peak, above what was in use before it ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _measure_cpu_peak(fn)


def _measure_cpu_peak(fn: Callable[[], object]) -> int:
    # The CPU allocator keeps no statistics: sample this process's resident size while fn runs.
    process = psutil.Process(os.getpid())
    before = process.memory_info().rss
    peak = before
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            done.wait(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        fn()
    finally:
        done.set()
        watcher.join()
    peak = max(peak, process.memory_info().rss)
    return max(peak - before, 0)


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int
    # How the budget was derived, for the startup log.
    source: str
    # Hybrid models: per-sequence state slots taken from the same budget (slot 0, all zeros,
    # is extra and not counted), and with prefix caching the checkpoint slots after them.
    num_state_slots: int = 0
    state_bytes_per_slot: int = 0
    num_checkpoint_slots: int = 0
    # Each KV group's window (None: whole context); a sequence holds blocks in every group.
    windows: tuple[int | None, ...] = (None,)
    # The most tokens one step computes for a sequence (a windowed group holds them too).
    max_chunk: int = 0

    @property
    def state_bytes(self) -> int:
        """The sequences' state slots and the zero slot (checkpoints: `checkpoint_bytes`)."""
        return (self.num_state_slots + 1) * self.state_bytes_per_slot if self.num_state_slots else 0

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoint_slots * self.state_bytes_per_slot

    @property
    def token_capacity(self) -> int:
        """Tokens of K/V the blocks hold in every group at once (block 0, the null block,
        holds none)."""
        return (self.num_blocks - 1) // max(len(self.windows), 1) * self.block_size

    def blocks_per_sequence(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most, over every group, while
        steps compute `chunk` of its tokens (default: the largest step; 1 for a decoding
        sequence)."""
        chunk = max(self.max_chunk if chunk is None else chunk, 1)
        return blocks_per_sequence(num_tokens, self.windows, self.block_size, chunk)

    def max_concurrency(self, max_model_len: int) -> float:
        return (self.num_blocks - 1) / self.blocks_per_sequence(max_model_len)


def plan_kv_cache(
    *,
    model_config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_memory_bytes: int | None,
    kv_format: KVCacheFormat | None = None,
    memory_utilization: float,
    total_memory: int,
    weight_bytes: int,
    activation_peak_bytes: int,
    max_num_seqs: int = 1,
    num_blocks_override: int | None = None,
    max_chunk: int = 0,
    extra_bytes_per_block: int = 0,
    state_checkpoints: bool = False,
    max_model_len: int = 0,
) -> KVCachePlan:
    """Blocks for the budget; a hybrid model first takes one state slot per sequence that may
    run (`max_num_seqs`), at most half the budget, so KV blocks are left for its attention
    layers (fewer slots then cap how many sequences run at once), and with
    `state_checkpoints` (prefix caching) up to an eighth of the budget for checkpoint slots,
    at most 1.5 per sequence slot, never taking blocks one sequence of `max_model_len`
    tokens needs. `num_blocks_override` fixes the block count instead (and
    gives a hybrid model a slot and a checkpoint per sequence).
    `extra_bytes_per_block`: a speculation drafter's K/V (a draft model's, an MTP
    layer's), held in the same blocks. `kv_format`: how the blocks hold K/V (default: in
    `dtype`)."""
    cache = kv_format or kv_cache_format("auto", dtype)
    bytes_per_block = kv_block_bytes(model_config, cache, block_size) + extra_bytes_per_block
    groups = {"windows": kv_layout(model_config).windows, "max_chunk": max_chunk}
    per_slot = state_bytes_per_sequence(model_config, dtype)
    if num_blocks_override is not None:
        slots = max_num_seqs if per_slot else 0
        checkpoints = slots if state_checkpoints else 0
        budget = num_blocks_override * bytes_per_block + (
            (slots + checkpoints + 1) * per_slot if slots else 0
        )
        source = f"num_gpu_blocks_override={num_blocks_override}"
        return KVCachePlan(
            num_blocks_override, block_size, bytes_per_block, budget, source, slots, per_slot,
            checkpoints, **groups,
        )  # fmt: skip
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
        source = f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    else:
        budget = int(memory_utilization * total_memory) - weight_bytes - activation_peak_bytes
        source = (
            f"{memory_utilization:.2f} x {total_memory / 2**30:.1f} GiB - weights "
            f"{weight_bytes / 2**30:.2f} GiB - activation peak "
            f"{activation_peak_bytes / 2**30:.2f} GiB"
        )
    slots = checkpoints = 0
    if per_slot:
        slots = max(min(max_num_seqs, (budget // 2) // per_slot - 1), 0)
    if slots and state_checkpoints:
        checkpoints = min(max(budget // CHECKPOINT_BUDGET_SHARE, 0) // per_slot, 3 * slots // 2)
        if model_config.attention_layers:
            needed = 1 + blocks_per_sequence(max_model_len, groups["windows"], block_size,
                                             max(max_chunk, 1))  # fmt: skip
            spare = budget - (slots + 1) * per_slot - needed * bytes_per_block
            checkpoints = max(min(checkpoints, spare // per_slot), 0)
    blocks_budget = budget - ((slots + checkpoints + 1) * per_slot if slots else 0)
    if not model_config.attention_layers:
        num_blocks = 2  # the null block and one more: the block tables still need a target
    else:
        num_blocks = max(blocks_budget // bytes_per_block, 0)
    return KVCachePlan(
        int(num_blocks), block_size, bytes_per_block, int(budget), source, slots, per_slot,
        checkpoints, **groups,
    )  # fmt: skip
