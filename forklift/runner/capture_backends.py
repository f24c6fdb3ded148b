"""How a decode step is captured: CUDA graphs on NVIDIA GPUs, compiled regions on CPUs."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CudaGraphBackend:
    """Records the step's kernels once into a `torch.cuda.CUDAGraph` and replays them: one
    launch per step instead of hundreds. All graphs share one memory pool."""

    name = "cuda-graph"

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self._pool: tuple[int, int] | None = None

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm up on a side stream so lazy initialisation (cuBLAS handles, allocator
        # growth) happens before, not during, the capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = run()
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class CompiledCpuBackend:
    """CPUs have no graph replay; the captured step runs the model with each decoder layer's
    dense regions compiled by torch.compile (the KV write and attention stay eager). The
    compilation itself happens in the runner, once for every shape; capture is a no-op."""

    name = "torch-compile"

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        run()  # compile for this shape now, not inside the first timed step
        return run


def backend_for(device: torch.device) -> CudaGraphBackend | CompiledCpuBackend:
    if device.type == "cuda":
        return CudaGraphBackend(device)
    return CompiledCpuBackend()
