"""Tensor parallelism's one rule: every runner call that touches the model runs on every rank,
in rank 0's order, so the collectives inside line up.

A runner method marked `@mirrored` keeps the rule itself. On rank 0 it sends its name and
arguments to the other ranks, which wait in `follow_rank0`, and runs; on any other rank, or
without tensor parallelism, it just runs. A mirrored method called from inside another one
runs locally only: the other ranks make that inner call themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, overload

from forklift.model.tp_group import TensorParallelGroup

R = TypeVar("R")
M = TypeVar("M", bound=Callable[..., Any])


@dataclass(frozen=True)
class MirroredCall:
    """One call as rank 0 sends it (pickled; tensors travel inside)."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class RankMirror:
    """Sends rank 0's mirrored calls to the other ranks; elsewhere it only runs them."""

    def __init__(self, tp: TensorParallelGroup | None) -> None:
        self._tp = tp
        self._depth = 0  # mirrored calls under way on this rank: only the outermost is sent

    def run(self, call: MirroredCall, body: Callable[[], R], rank0_first: bool) -> R:
        send = self._drives() and self._depth == 0
        self._depth += 1
        try:
            if send and not rank0_first:
                self._send(call)
            result = body()
            if send and rank0_first:
                self._send(call)  # only once rank 0's run has succeeded
            return result
        finally:
            self._depth -= 1

    def stop(self) -> None:
        """Rank 0: end the other ranks' `follow_rank0` loops."""
        if self._drives():
            self._send(None)

    def _drives(self) -> bool:
        return self._tp is not None and self._tp.rank == 0

    def _send(self, call: MirroredCall | None) -> None:
        assert self._tp is not None
        self._tp.broadcast_object(call)


class Mirrors(Protocol):
    """A class whose methods can be `@mirrored`: its instances hold their rank's mirror."""

    mirror: RankMirror


@overload
def mirrored(method: M, /) -> M: ...
@overload
def mirrored(*, rank0_first: bool = False) -> Callable[[M], M]: ...
def mirrored(method: M | None = None, /, *, rank0_first: bool = False) -> M | Callable[[M], M]:
    """Mark a method every rank runs. With `rank0_first`, rank 0 runs it before the other
    ranks see the call: what it checks there, they then take on trust."""

    def decorate(method: M) -> M:
        @functools.wraps(method)
        def call(owner: Mirrors, *args: Any, **kwargs: Any) -> Any:
            message = MirroredCall(method.__name__, args, kwargs)
            body = functools.partial(method, owner, *args, **kwargs)
            return owner.mirror.run(message, body, rank0_first)

        return cast(M, call)

    return decorate if method is None else decorate(method)


def follow_rank0(owner: Mirrors, tp: TensorParallelGroup) -> None:
    """A worker rank's life after setup: run each call rank 0 sends, until it stops."""
    while (call := tp.broadcast_object()) is not None:
        getattr(owner, call.method)(*call.args, **call.kwargs)
