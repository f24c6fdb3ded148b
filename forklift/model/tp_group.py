"""The collectives a tensor-parallel group needs, on a private torch.distributed process group.

Gloo on a CPU, NCCL on a GPU. The group is built from its own TCPStore rather than
`init_process_group`, so no process-wide default group exists and an engine can be created
and closed several times in one process. Rank 0 (the engine's process) hosts the store.
"""

from __future__ import annotations

import logging
import pickle
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("forklift")

_TIMEOUT = timedelta(minutes=30)


def create_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free loopback port (read it back from `.port`)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=_TIMEOUT, wait_for_workers=False)


def connect_store(port: int, world_size: int) -> dist.TCPStore:
    """A worker rank's client of rank 0's store."""
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=_TIMEOUT)


class TensorParallelGroup:
    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.Store,
        device: torch.device,
        allow_cross_node: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        if device.type == "cuda":
            self._pg: Any = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, _TIMEOUT)
        store.set(f"host/{rank}", socket.gethostname())
        hosts = [store.get(f"host/{r}").decode() for r in range(world_size)]
        check_single_node(hosts, allow_cross_node)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self._pg.allreduce([tensor]).wait()
        return tensor

    def all_gather_cat(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [[torch.empty_like(tensor) for _ in range(self.world_size)]]
        self._pg.allgather(parts, [tensor.contiguous()]).wait()
        return torch.cat(parts[0], dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; tensors travel inside)."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        moved = tensor.to(self.device) if self.device.type == "cuda" else tensor
        self._pg.broadcast([moved], dist.BroadcastOptions()).wait()
        if moved is not tensor:
            tensor.copy_(moved.cpu())


def check_single_node(hostnames: list[str], allow_cross_node: bool) -> None:
    """Tensor parallelism all-reduces twice per layer per step: over an ordinary network
    that costs more than the compute it splits (benchmarks/scale.md)."""
    if len(set(hostnames)) <= 1:
        return
    message = (
        f"the tensor-parallel group spans machines ({', '.join(sorted(set(hostnames)))}); "
        "its per-layer all-reduces would run over the network. Use data parallelism "
        "across machines and tensor parallelism inside one"
    )
    if not allow_cross_node:
        raise ValueError(message + " (allow_cross_node_tensor_parallel=True overrides this)")
    logger.warning(
        "WARNING: %s. Continuing because allow_cross_node_tensor_parallel=True.", message
    )
