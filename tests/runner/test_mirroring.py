"""@mirrored runner methods: what rank 0 sends to the other ranks, and when."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from forklift.runner.mirroring import MirroredCall, RankMirror, follow_rank0, mirrored


@dataclass
class RecordingGroup:
    """A stand-in for TensorParallelGroup: rank 0 records broadcasts, a worker replays them."""

    rank: int
    inbox: list[Any] = field(default_factory=list)
    sent: list[Any] = field(default_factory=list)

    def broadcast_object(self, obj: Any = None) -> Any:
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        return self.inbox.pop(0)


class Runner:
    def __init__(self, tp: RecordingGroup | None) -> None:
        self.mirror = RankMirror(tp)  # type: ignore[arg-type]
        self.log: list[tuple[str, int]] = []
        self.tp = tp

    @mirrored
    def step(self, n: int) -> int:
        self.log.append(("step", len(self.tp.sent) if self.tp else 0))
        return self.inner(n) + 1

    @mirrored
    def inner(self, n: int) -> int:
        return n

    @mirrored(rank0_first=True)
    def stage(self, value: int) -> int:
        if value < 0:
            raise ValueError("bad")
        self.log.append(("stage", len(self.tp.sent) if self.tp else 0))
        return value


def test_rank0_sends_before_running_and_nested_calls_stay_local():
    group = RecordingGroup(rank=0)
    runner = Runner(group)
    assert runner.step(3) == 4
    assert group.sent == [MirroredCall("step", (3,), {})]  # `inner` is not sent again
    assert runner.log == [("step", 1)]


def test_rank0_first_sends_only_after_its_own_run_succeeds():
    group = RecordingGroup(rank=0)
    runner = Runner(group)
    with pytest.raises(ValueError):
        runner.stage(-1)
    assert group.sent == []
    assert runner.stage(5) == 5
    assert runner.log == [("stage", 0)] and group.sent == [MirroredCall("stage", (5,), {})]


def test_a_worker_replays_rank0_calls_until_stopped():
    rank0 = Runner(RecordingGroup(rank=0))
    rank0.step(1)
    rank0.stage(2)
    rank0.mirror.stop()
    worker_group = RecordingGroup(rank=1, inbox=list(rank0.tp.sent))
    worker = Runner(worker_group)
    follow_rank0(worker, worker_group)  # type: ignore[arg-type]
    assert [name for name, _ in worker.log] == ["step", "stage"]
    assert worker_group.sent == []


def test_without_tensor_parallelism_methods_just_run():
    runner = Runner(None)
    assert runner.step(1) == 2 and runner.stage(4) == 4
    runner.mirror.stop()
