"""`forklift bench spec`: speculative decoding against none, and against llama-server's n-gram
modes on the same GGUF file, side by side in one run.

Each configuration is a server started for it (one at a time, so they never share the cores)
and loaded with both workloads (forklift/bench/spec_workload.py) at each concurrency: every
prompt once, greedy, as chat requests; output tok/s is output tokens over the wall time of
the level. Acceptance comes from forklift's /metrics and from llama-server's per-response
`timings` (draft tokens and accepted ones).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from forklift.bench.report import cpu_flags, markdown_table, subplots, write_report_files
from forklift.bench.server_process import forklift_server_process, llama_server_process
from forklift.bench.spec_workload import WORKLOADS
from forklift.bench.stream_client import RequestTiming, request_body, stream_request
from forklift.checkpoint.source import resolve_model

FORKLIFT_METHODS = (
    "none",
    '{"method": "ngram", "num_speculative_tokens": 8}',
    '{"method": "suffix", "num_speculative_tokens": 12}',
)
LLAMA_MODES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


@dataclass
class SpecSettings:
    model: str | None = None  # the default model
    llama_server: str | None = None  # llama.cpp's llama-server binary; None: forklift only
    threads: int | None = None  # llama-server -t / -tb (default: torch's thread count)
    max_tokens: int = 192
    grounded_concurrency: tuple[int, ...] = (1, 4)
    chat_concurrency: tuple[int, ...] = (1, 8)
    forklift_methods: tuple[str, ...] = FORKLIFT_METHODS
    llama_modes: tuple[str, ...] = LLAMA_MODES
    prompts: int | None = None  # per workload; None: all of them

    @classmethod
    def quick(cls, **overrides: Any) -> SpecSettings:
        quick = {"max_tokens": 24, "grounded_concurrency": (1,), "chat_concurrency": (2,),
                 "prompts": 2, "llama_modes": ("none", "ngram-simple")}  # fmt: skip
        return cls(**(quick | overrides))


@dataclass
class SpecPoint:
    engine: str  # "forklift" or "llama-server"
    mode: str  # "none", a forklift method or a llama-server --spec-type
    workload: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    # After each request's first token: tokens and seconds (what speculation speeds up;
    # a request's prefill is in its time to first token).
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # forklift: verifications (llama-server does not report them).
    drafts: int | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Per stream: decode tokens over the summed decode time of the requests."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None


def run_spec_bench(settings: SpecSettings) -> dict[str, Any]:
    source = resolve_model(settings.model)
    threads = settings.threads or torch.get_num_threads()
    points: list[SpecPoint] = []
    for method in settings.forklift_methods:
        args = ["--model", str(source.path)]
        args += ["--speculative-config", method] if method != "none" else []
        server = forklift_server_process(args)
        points += _measure(server, "forklift", _mode_name(method), settings)
    if settings.llama_server:
        if source.format != "gguf":
            raise ValueError("--llama-server needs a GGUF model: it serves the same file")
        for mode in settings.llama_modes:
            extra = ["--spec-type", mode] if mode != "none" else []
            server = llama_server_process(
                settings.llama_server, source.path, threads, extra_args=extra
            )
            points += _measure(server, "llama-server", mode, settings)
    return {
        "cpu_flags": cpu_flags(),
        "threads": threads,
        "model": source.path.name,
        "settings": asdict(settings) | {"llama_server": bool(settings.llama_server)},
        "points": [asdict(p) | _derived(p) for p in points],
        "summary": summarize(points),
    }


def _mode_name(method: str) -> str:
    """ "none", or the method with its drafts per step and any other key given."""
    if method == "none":
        return "none"
    config = json.loads(method)
    name = config.pop("method")
    drafts = config.pop("num_speculative_tokens", None)
    extra = "".join(f" {key}={value}" for key, value in config.items())
    return f"{name} k={drafts}{extra}" if drafts is not None else f"{name}{extra}"


def _derived(point: SpecPoint) -> dict[str, Any]:
    return {
        "decode_tokens_per_s": point.decode_tokens_per_s,
        "mean_ttft_s": sum(point.ttft_s) / len(point.ttft_s) if point.ttft_s else None,
        "acceptance_rate": point.acceptance_rate,
        "mean_acceptance_length": point.mean_acceptance_length,
    }


def _measure(
    server: AbstractContextManager[tuple[str, int]], engine: str, mode: str, settings: SpecSettings
) -> list[SpecPoint]:
    points = []
    with server as (base_url, _):
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(_warm_up(base_url, model))
        for workload, concurrencies in _levels(settings):
            prompts = list(WORKLOADS[workload][: settings.prompts])
            for concurrency in concurrencies:
                before = _forklift_counters(base_url) if engine == "forklift" else None
                point = SpecPoint(engine, mode, workload, concurrency, len(prompts), 0, 0.0, 0.0)
                asyncio.run(_one_level(base_url, model, point, prompts, settings))
                if before is not None:
                    after = _forklift_counters(base_url)
                    point.drafts = after[0] - before[0]
                    point.draft_tokens = after[1] - before[1]
                    point.accepted_tokens = after[2] - before[2]
                points.append(point)
    return points


def _levels(settings: SpecSettings) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield "input-grounded", settings.grounded_concurrency
    yield "open-chat", settings.chat_concurrency


async def _warm_up(base_url: str, model: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()


async def _one_level(
    base_url: str, model: str, point: SpecPoint, prompts: list[str], settings: SpecSettings
) -> None:
    """Every prompt once, `point.concurrency` at a time; fills in the point."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            body = request_body("chat", model, queue.get_nowait(), settings.max_tokens, False)
            _record(point, await stream_request(client, "chat", body))

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(point.concurrency)))
    point.seconds = time.perf_counter() - started
    point.output_tokens_per_s = point.output_tokens / point.seconds


def _record(point: SpecPoint, timing: RequestTiming) -> None:
    """One streamed request into its level: tokens, decode time (first content chunk to
    last) and, from llama-server, its draft counters."""
    if not timing.ok:
        point.errors.append(timing.error)
        return
    point.output_tokens += timing.output_tokens
    point.ttft_s.append(timing.ttft_s)
    if timing.output_tokens > 1:
        point.decode_tokens += timing.output_tokens - 1
        point.decode_seconds += sum(timing.itl_s)
    point.draft_tokens += int(timing.server_timings.get("draft_n", 0))
    point.accepted_tokens += int(timing.server_timings.get("draft_n_accepted", 0))


def _forklift_counters(base_url: str) -> tuple[int, int, int]:
    """(verifications, draft tokens, accepted tokens) from forklift's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    values = dict.fromkeys(wanted, 0)
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in wanted:
                if sample.name == f"forklift:spec_decode_{name}_total":
                    values[name] = int(sample.value)
    return values["num_drafts"], values["num_draft_tokens"], values["num_accepted_tokens"]


def summarize(points: list[SpecPoint]) -> list[dict[str, Any]]:
    """Per workload and concurrency: each forklift method's speed-up over forklift without
    speculation (output tok/s over the wall time; decode tok/s per stream), and the best
    forklift method against llama-server's best n-gram mode on both."""
    rows = []
    for workload, concurrency in sorted({(p.workload, p.concurrency) for p in points}):
        here = [p for p in points if (p.workload, p.concurrency) == (workload, concurrency)]
        ours = {p.mode: p for p in here if p.engine == "forklift"}
        peer = {p.mode: p for p in here if p.engine == "llama-server"}
        row: dict[str, Any] = {"workload": workload, "concurrency": concurrency}
        base = ours.get("none")
        for mode, point in ours.items():
            if mode != "none" and base is not None and base.output_tokens_per_s:
                row[f"{mode}: output"] = point.output_tokens_per_s / base.output_tokens_per_s
                row[f"{mode}: decode"] = point.decode_tokens_per_s / base.decode_tokens_per_s
        speculating = [p for m, p in ours.items() if m != "none"]
        peer_speculating = [p for m, p in peer.items() if m != "none"]
        if speculating and peer_speculating:
            best = max(speculating, key=lambda p: p.output_tokens_per_s)
            peer_best = max(peer_speculating, key=lambda p: p.output_tokens_per_s)
            row["best forklift"] = best.mode
            row["best llama-server"] = peer_best.mode
            row["best vs best: output"] = best.output_tokens_per_s / peer_best.output_tokens_per_s
            row["best vs best: decode"] = best.decode_tokens_per_s / peer_best.decode_tokens_per_s
        if base is not None and "none" in peer:
            row["none vs none: output"] = (
                base.output_tokens_per_s / peer["none"].output_tokens_per_s
            )
        rows.append(row)
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Speculative decoding: forklift vs none vs llama-server's n-gram modes",
        "",
        f"Model `{report['model']}`, greedy chat requests of at most "
        f"{report['settings']['max_tokens']} tokens, {report['threads']} threads; one server at "
        "a time, every prompt of the workload once per level, streamed. Output tok/s: all "
        "output tokens over the level's wall time (prefills included); decode tok/s per "
        "stream: tokens after each request's first over the time they took (what "
        "speculation changes).",
        f"CPU flags: {' '.join(report['cpu_flags'])}",
        "",
    ]
    header = ["engine", "mode", "workload", "c", "output tok/s", "decode tok/s per stream",
              "mean TTFT (s)", "tokens", "acceptance rate", "mean acceptance length",
              "errors"]  # fmt: skip
    rows = []
    for p in report["points"]:
        rate, length = p["acceptance_rate"], p["mean_acceptance_length"]
        rows.append([
            p["engine"], p["mode"], p["workload"], p["concurrency"],
            f"{p['output_tokens_per_s']:.1f}", f"{p['decode_tokens_per_s']:.1f}",
            "-" if p["mean_ttft_s"] is None else f"{p['mean_ttft_s']:.2f}", p["output_tokens"],
            "-" if rate is None else f"{rate:.2f}", "-" if length is None else f"{length:.2f}",
            len(p["errors"]),
        ])  # fmt: skip
    lines += markdown_table(header, rows)
    lines += ["", "## Ratios (same run)", ""]
    for row in report["summary"]:
        parts = [f"{k} {v:.2f}x" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                 if k not in ("workload", "concurrency")]  # fmt: skip
        lines.append(f"- {row['workload']}, c={row['concurrency']}: " + "; ".join(parts))
    if report.get("command"):
        lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any]) -> Any:
    levels = sorted({(p["workload"], p["concurrency"]) for p in report["points"]})
    figure, axes = subplots(1, len(levels), figsize=(4.5 * len(levels), 4), squeeze=False)
    for axis, (workload, concurrency) in zip(axes[0], levels, strict=True):
        here = [p for p in report["points"]
                if (p["workload"], p["concurrency"]) == (workload, concurrency)]  # fmt: skip
        labels = [f"{'fl' if p['engine'] == 'forklift' else 'llama'}\n{p['mode']}" for p in here]
        colours = ["tab:blue" if p["engine"] == "forklift" else "tab:gray" for p in here]
        axis.bar(range(len(here)), [p["output_tokens_per_s"] for p in here], color=colours)
        axis.set_xticks(range(len(here)), labels, fontsize=7, rotation=45)
        axis.set_title(f"{workload}, c={concurrency}")
        axis.set_ylabel("output tok/s")
    return figure


def write_report(report: dict[str, Any], out_dir: Path, name: str = "spec") -> list[Path]:
    return write_report_files(report, out_dir, name, render_markdown, plot)
