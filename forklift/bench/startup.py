"""`forklift bench startup`: how long `forklift serve` takes to be ready, cold and warm.

Each start is a fresh process: time until /health answers, then the time of a first
16-token completion (which, with captured decode, includes compiling its shapes). "Cold"
starts with an empty torch.compile cache directory; "warm" reuses the one the cold start
filled. Eager decode compiles nothing, so its cold and warm starts differ only by the
operating system's file cache.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from forklift.bench.environment import environment_variable
from forklift.bench.report import cpu_flags, write_report_files
from forklift.bench.server_process import forklift_server


@dataclass
class StartupPoint:
    mode: str
    cache: str
    ready_s: float
    first_completion_s: float


def _one_start(extra_args: list[str], cache_dir: str) -> tuple[float, float]:
    with environment_variable("TORCHINDUCTOR_CACHE_DIR", cache_dir):
        start = time.perf_counter()
        with forklift_server(extra_args) as url:
            ready = time.perf_counter() - start
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            begin = time.perf_counter()
            response = httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                      "temperature": 0, "ignore_eos": True},
                timeout=600,
            )  # fmt: skip
            response.raise_for_status()
            return ready, time.perf_counter() - begin


def run_startup_bench(model: str | None = None) -> dict[str, Any]:
    base = ["--model", model] if model else []
    points = []
    for mode, flag in (("eager", "--enforce-eager"), ("captured", "--no-enforce-eager")):
        with tempfile.TemporaryDirectory() as cache_dir:
            for cache in ("cold", "warm"):
                ready, first = _one_start([*base, flag], cache_dir)
                points.append(StartupPoint(mode, cache, ready, first))
    points_json = [asdict(p) for p in points]
    return {"benchmark": "startup", "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
            "points": points_json}  # fmt: skip


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# `forklift serve` start-up time",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['cores']} cores. Ready: process start until /health answers (model load, KV "
        "budget profiling, HTTP up). First completion: a 16-token request right after, which "
        "in captured mode includes compiling. Cold: empty torch.compile cache; warm: the "
        "cache the cold start filled. "
        f"CPU flags: {' '.join(report.get('cpu_flags', [])) or 'n/a'}.",
        "",
        "| decode mode | compile cache | ready (s) | first completion (s) | ready + first (s) |",
        "|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['mode']} | {p['cache']} | {p['ready_s']:.1f} | {p['first_completion_s']:.1f} "
            f"| {p['ready_s'] + p['first_completion_s']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "startup", render_markdown, None)
