"""What PyTorch 2.13 and torchao offer for a decode step's quantized matmuls, against the
block kernel the native step runs (forklift/native/csrc/quant_matmul.h), side by side in one
process: the default model's 30 layers of projections (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536; each layer its own weights, so they stream from memory as in a
decode step) at 1 to 32 rows, every backend called from Python once per matmul.

Backends:
- forklift's block int4 (groups of 32 with a scale and a minimum, the Q4_1 file's form);
- ATen's `_weight_int4pack_mm_for_cpu` (the PyTorch layers' int4, and the op torchao's CPU
  int4 layout called before torchao 0.18 dropped it), eager and under Inductor max-autotune
  (its CPP GEMM template for weight-only int4, with frozen weights);
- ATen's `_weight_int8pack_mm` (int8 weights, one scale per output; torchao's
  Int8WeightOnlyConfig runs it), eager and under Inductor max-autotune;
- torchao's Int8DynamicActivationInt8WeightConfig (int8 activations per row), eager and
  under Inductor max-autotune, if torchao imports (`.venv/bin/pip install torchao==0.18.0`);
- oneDNN's bf16 linear on the dense weights, for scale.
Writes benchmarks/<dir>/matmul-backends.{md,json}.

Run: .venv/bin/python benchmarks/scripts/matmul_backends.py [out_dir]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from dense_tiles import LAYERS, SHAPES
from results import command_line, write_results
from revision_build import ROOT

from forklift.bench.report import cpu_flags
from forklift.model.layers.block_weights import BlockInt4
from forklift.model.layers.quantized import PackedInt4, PackedInt8, int4_groups_from_dense
from forklift.native.quant_matmul import QuantMatmulKernel

ROWS, ROUNDS = (1, 8, 16, 32), 7

Backend = Callable[[dict[int, torch.Tensor]], None]


class _Int4Pack(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        packed = PackedInt4.pack(int4_groups_from_dense(weight.float()))
        self.packed = torch.nn.Parameter(packed.packed, requires_grad=False)
        self.scales = torch.nn.Parameter(packed.scales_and_zeros, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, 32, self.scales)


class _Int8Pack(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        packed = PackedInt8.quantize(weight)
        self.codes = torch.nn.Parameter(packed.weight, requires_grad=False)
        self.scales = torch.nn.Parameter(packed.scales, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inductor lowers the op itself to its CPP template; the same product written as
        # mm(x, codes.to(bf16).T) * scales gets its widened codes folded into bf16 weights.
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)


class _Layers(torch.nn.Module):
    """Every layer's matmul in one module: one compiled graph runs them all."""

    def __init__(self, modules: list[torch.nn.Module], in_features: list[int]) -> None:
        super().__init__()
        self.matmuls = torch.nn.ModuleList(modules)
        self.in_features = in_features

    def forward(self, x576: torch.Tensor, x1536: torch.Tensor) -> list[torch.Tensor]:
        inputs = {576: x576, 1536: x1536}
        return [m(inputs[k]) for m, k in zip(self.matmuls, self.in_features, strict=True)]


def _eager(layers: _Layers) -> Backend:
    return lambda x: layers(x[576], x[1536])


def _compiled(layers: _Layers, rows: int) -> Backend:
    """Inductor max-autotune with frozen weights (its CPP GEMM templates want constants),
    compiled for this row count; checked against the eager module."""
    import torch._inductor.config as inductor

    inductor.freezing = True
    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    torch._dynamo.reset()
    compiled = torch.compile(layers)
    x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    got, want = compiled(x[576], x[1536]), layers(x[576], x[1536])
    for a, b in zip(got, want, strict=True):
        error = (a.float() - b.float()).norm() / b.float().norm()
        assert error < 2e-2, f"the compiled module's outputs differ from eager ({error:.3g})"
    return lambda x: compiled(x[576], x[1536])


def _torchao_dynamic_int8(weights: list[torch.Tensor]) -> _Layers | None:
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        return None
    linears = torch.nn.ModuleList()
    for weight in weights:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        linears.append(linear)
    quantize_(linears, Int8DynamicActivationInt8WeightConfig())
    return _Layers(list(linears), [w.shape[1] for w in weights]).eval()


def _native(weights: list[torch.Tensor]) -> Backend:
    kernel = QuantMatmulKernel.load()
    assert kernel is not None, "no native build on this machine"
    blocks = [BlockInt4.from_dense(w.float(), kernel) for w in weights]
    # The native step's activations are fp32: each input widened once, outside the timings.
    widened: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(x: dict[int, torch.Tensor]) -> None:
        for width, rows in x.items():
            if width not in widened or widened[width][0] is not rows:
                widened[width] = (rows, rows.float())
        for block in blocks:
            block.linear(widened[block.shape[1]][1])

    return run


def _inputs(rows: int, gen: torch.Generator) -> dict[int, torch.Tensor]:
    """bf16 rows by width."""
    return {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}


def _rows(count: int) -> str:
    return f"{count} row" if count == 1 else f"{count} rows"


def _time(backend: Backend, inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    backend(inputs)
    return time.perf_counter() - started


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "benchmarks"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16()
               for _ in range(LAYERS) for n, k in SHAPES]  # fmt: skip
    in_features = [w.shape[1] for w in weights]
    int4 = _Layers([_Int4Pack(w) for w in weights], in_features).eval()
    int8 = _Layers([_Int8Pack(w) for w in weights], in_features).eval()
    dense = _Layers([torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights],
                    in_features).eval().bfloat16()  # fmt: skip
    for linear, w in zip(dense.matmuls, weights, strict=True):
        linear.weight.copy_(w)
    megabytes = {
        "forklift block int4 (native)": sum(
            BlockInt4.from_dense(w.float(), None).nbytes for w in weights[:4]
        )
        * LAYERS
        / 1e6,  # fmt: skip
        "int4pack": sum(p.numel() * p.element_size() for p in int4.parameters()) / 1e6,
        "int8pack": sum(p.numel() * p.element_size() for p in int8.parameters()) / 1e6,
        "bf16": sum(w.numel() * 2 for w in weights) / 1e6,
    }
    native = _native(weights)
    dynamic = _torchao_dynamic_int8(weights)
    results = []
    for rows in ROWS:
        backends: dict[str, Backend] = {
            "forklift block int4 (native)": native,
            "ATen int4pack, eager": _eager(int4),
            "ATen int4pack, Inductor max-autotune": _compiled(int4, rows),
            "ATen int8pack, eager": _eager(int8),
            "ATen int8pack, Inductor max-autotune": _compiled(int8, rows),
            "oneDNN bf16 linear": _eager(dense),
        }
        if dynamic is not None:
            backends["torchao dynamic int8 (W8A8), eager"] = _eager(dynamic)
            backends["torchao dynamic int8 (W8A8), Inductor max-autotune"] = _compiled(
                dynamic, rows
            )
        inputs = _inputs(rows, gen)
        times: dict[str, list[float]] = {name: [] for name in backends}
        for round_index in range(ROUNDS + 1):  # round 0 warms every backend up
            for name, backend in backends.items():
                seconds = _time(backend, inputs)
                if round_index:
                    times[name].append(seconds)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        results.append({"rows": rows, "ms": ms})
        print(results[-1], flush=True)
    names = list(results[0]["ms"])
    fastest_other = {
        r["rows"]: min(v for n, v in r["ms"].items() if not n.startswith("forklift"))
        for r in results
    }
    report = {"cpu_flags": cpu_flags(), "rounds": ROUNDS, "weight_mb": megabytes,
              "torch": torch.__version__, "rows": results}  # fmt: skip
    shapes = ", ".join(f"{n}x{k}" for n, k in SHAPES)
    lines = [
        "# Quantized matmuls for the decode step: what PyTorch and torchao offer",
        "",
        f"The default model's {LAYERS} layers of projections ({shapes}), each layer its own "
        "weights, every backend called once per matmul from Python, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; the backends alternate "
        f"round by round, median of {ROUNDS} rounds (ms for all {LAYERS * len(SHAPES)} matmuls).",
        "",
        "| backend | " + " | ".join(f"{_rows(r)} (ms)" for r in ROWS) + " |",
        "|---|" + "---:|" * len(ROWS),
        *(
            "| " + " | ".join([name, *(f"{r['ms'][name]:.2f}" for r in results)]) + " |"
            for name in names
        ),  # fmt: skip
        "",
        "forklift's block kernel against the fastest of the others: "
        + ", ".join(
            f"{fastest_other[r['rows']] / r['ms']['forklift block int4 (native)']:.2f}x at "
            f"{_rows(r['rows'])}"
            for r in results
        )
        + ".",
        "",
        f"Weights read per call of the {LAYERS * len(SHAPES)} matmuls (MB): "
        + ", ".join(f"{name} {mb:.0f}" for name, mb in megabytes.items())
        + ".",
        "",
    ]
    write_results(out_dir, "matmul-backends", report, lines, command_line(__file__, out_dir))


if __name__ == "__main__":
    main()
