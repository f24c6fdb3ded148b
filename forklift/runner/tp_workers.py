"""Worker processes of a tensor-parallel engine.

The engine's process is rank 0: it schedules, samples and drives. Ranks 1..N-1 are spawned
processes that each build a `ModelRunner` over their shard and then mirror rank 0: every
`@mirrored` runner call rank 0 makes (a forward step, KV allocation, a weight update...) is
broadcast as (method, arguments) and executed on every rank (runner/mirroring.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from forklift.checkpoint.source import resolve_model
from forklift.config import EngineConfig
from forklift.model.model_config import ModelConfig
from forklift.model.model_source import iter_model_weights, load_model_config, quantization_plan
from forklift.model.tensor_parallel import check_tensor_parallel_size
from forklift.model.tp_group import TensorParallelGroup, connect_store, create_store
from forklift.runner.mirroring import follow_rank0

logger = logging.getLogger("forklift")


@dataclass(frozen=True)
class RankSpec:
    """What a worker rank needs to build the same runner as rank 0 (picklable)."""

    model: str  # the path rank 0 resolved
    device: str
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    sliding_window: int | None
    num_threads: int | None
    allow_cross_node: bool
    quantization: str = "none"  # the method rank 0 resolved
    decode_backend: str = "auto"
    kv_cache_dtype: str = "auto"


@dataclass
class TensorParallelWorkers:
    group: TensorParallelGroup
    store: dist.Store  # rank 0 hosts it: it must outlive the group
    processes: list[BaseProcess] = field(default_factory=list)

    def raise_if_dead(self, cause: BaseException) -> None:
        """After a failed collective: name the rank that died, its exit code and error."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=1.0)  # a peer's death reaches rank 0 just before its exit
            if process.exitcode is not None:
                raise RuntimeError(rank_died_message(rank, process.exitcode, self.store)) from cause

    def join(self, timeout_s: float = 30.0) -> None:
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()


def cpu_threads_per_rank(config: EngineConfig) -> int:
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def start_tensor_parallel(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    spec: RankSpec,
) -> TensorParallelWorkers | None:
    """Spawn ranks 1..N-1 and join them in a group; None when tensor_parallel_size is 1."""
    world = config.tensor_parallel_size
    if world == 1:
        return None
    check_tensor_parallel_size(model_config, world)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(config))
    store = create_store(world)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=serve_rank,
            args=(rank, world, store.port, spec),
            daemon=True,
            name=f"forklift-tp-rank-{rank}",
        )  # fmt: skip
        for rank in range(1, world)
    ]
    for process in processes:
        process.start()
    wait_for_ranks(store, processes)
    group = TensorParallelGroup(0, world, store, device, spec.allow_cross_node)
    logger.info("tensor parallel: %d ranks on %s", world, device)
    return TensorParallelWorkers(group, store, processes)


# How long rank 0 waits for its ranks to join, and how often it looks whether one died.
JOIN_TIMEOUT_S = 300.0
_POLL_S = 0.05


def wait_for_ranks(
    store: dist.Store, processes: list[BaseProcess], timeout_s: float = JOIN_TIMEOUT_S
) -> None:
    """Block until every spawned rank has joined, raising at once if one exits first (the
    group's own rendezvous would wait for it for the whole group timeout)."""
    keys = [_joined_key(rank) for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if process.exitcode is not None:
                raise RuntimeError(rank_died_message(rank, process.exitcode, store))
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel ranks did not join within {timeout_s:.0f} s "
                "(is the machine overloaded?)"
            )
        time.sleep(_POLL_S)


def rank_died_message(rank: int, exitcode: int, store: dist.Store) -> str:
    error_key = _error_key(rank)
    last_error = store.get(error_key).decode() if store.check([error_key]) else None
    if last_error is not None:
        return f"tensor-parallel rank {rank} exited with code {exitcode}: {last_error}"
    return (
        f"tensor-parallel rank {rank} exited with code {exitcode} before joining the group "
        "(its traceback is above). Ranks are spawned processes that import the main script "
        "again: a script that builds LLM(tensor_parallel_size > 1) or an LLMEngine at import "
        'time needs the `if __name__ == "__main__":` guard around that code.'
    )


def _joined_key(rank: int) -> str:
    return f"joined/{rank}"


def _error_key(rank: int) -> str:
    return f"error/{rank}"


def serve_rank(rank: int, world: int, port: int, spec: RankSpec) -> None:
    """A worker rank's whole life: join the group, build the shard, mirror rank 0. An error
    is left in the store for rank 0 to report before the rank exits."""
    store = connect_store(port, world)
    store.set(_joined_key(rank), "1")
    try:
        _serve_rank(rank, world, store, spec)
    except BaseException as exc:
        with contextlib.suppress(Exception):  # rank 0 (the store's host) may be gone
            store.set(_error_key(rank), f"{type(exc).__name__}: {exc}")
        raise


def _serve_rank(rank: int, world: int, store: dist.Store, spec: RankSpec) -> None:
    from forklift.runner.model_runner import ModelRunner  # after spawn, not at import

    device = torch.device(spec.device)
    if device.type == "cpu" and spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    group = TensorParallelGroup(rank, world, store, device, spec.allow_cross_node)
    source = resolve_model(spec.model)
    model_config = load_model_config(source)
    runner = ModelRunner(
        model_config,
        partial(iter_model_weights, source, model_config),
        device=device,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        sliding_window=spec.sliding_window,
        tp=group,
        quantization=quantization_plan(source, model_config, spec.quantization),
        decode_backend=spec.decode_backend,
        kv_cache_dtype=spec.kv_cache_dtype,
    )
    follow_rank0(runner, group)
