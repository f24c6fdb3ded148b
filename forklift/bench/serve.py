"""`forklift bench serve`: a streaming load sweep against an OpenAI-compatible server.

Each concurrency level sends its requests through a semaphore of that size, so exactly
`concurrency` requests are in flight until the queue drains. Prompts are synthetic text of
an exact token count, unique per request, and every request asks for a fixed number of
output tokens with `ignore_eos`.

With a peer (`peer_url`, any OpenAI-compatible server, or `llama_server`, llama.cpp's server
started on the same GGUF file with fair settings) the same sweep, the same prompts in the same
order, runs against it after forklift, one server at a time, and the report gives the ratio
per concurrency. When the benchmark starts forklift itself, it also samples the server's CPU
time per level: the event-loop thread (HTTP, JSON, SSE) apart from everything else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from forklift.bench.report import cpu_flags, subplots, write_report_files
from forklift.bench.server_process import (
    forklift_server_process,
    llama_server_process,
    shell_server_process,
)
from forklift.bench.stream_client import RequestTiming, request_body, stream_request
from forklift.bench.synthetic_prompt import synthetic_prompt
from forklift.checkpoint.source import resolve_model
from forklift.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class ServeSettings:
    base_url: str | None = None
    model: str | None = None  # local model: its tokenizer, and the server started without URL
    served_model: str | None = None  # name sent in requests (default: the server's first)
    endpoint: str = "completions"
    input_tokens: int = 564
    output_tokens: int = 128
    concurrencies: tuple[int, ...] = (1, 4, 8, 16, 32)
    min_requests: int = 8
    requests_per_concurrency: int = 4
    warmup_requests: int = 2
    api_key: str | None = None
    server_args: list[str] = field(default_factory=list)
    peer_url: str | None = None  # another OpenAI-compatible server, loaded the same way
    # A shell command that starts the peer at peer_url after forklift's sweep (and is stopped
    # after the peer's): each server then has the machine, and its memory, to itself.
    peer_command: str | None = None
    llama_server: str | None = None  # llama.cpp's llama-server binary, started on the GGUF
    peer_threads: int | None = None  # llama-server -t / -tb (default: torch's thread count)

    @classmethod
    def quick(cls, **overrides: Any) -> ServeSettings:
        settings = cls(**{"input_tokens": 128, "output_tokens": 16, "concurrencies": (1, 4),
                          "min_requests": 4, "requests_per_concurrency": 1,
                          "warmup_requests": 1, **overrides})  # fmt: skip
        if not settings.server_args:
            # A started server needs no more context than these requests: its start-up then
            # profiles a 512-token step, not a 2048-token one (seconds on two cores).
            length = max(512, settings.input_tokens + settings.output_tokens)
            settings.server_args = ["--max-model-len", str(length)]
        return settings

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_concurrency * concurrency)

    def validate(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        if self.peer_url and self.llama_server:
            raise ValueError("give a peer URL or a llama-server binary, not both")
        if self.peer_command and not self.peer_url:
            raise ValueError("peer_command needs peer_url: where the started peer answers")


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    completed: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    tpot_ms_mean: float
    e2e_s_p50: float
    e2e_s_p99: float
    itl_ms_max: float
    prompt_tokens: list[int]
    per_request_output_tokens: list[int]
    errors: list[str]
    scaling: float = 0.0  # output tok/s relative to the lowest concurrency level
    # forklift started by the benchmark: CPU seconds of its process during the level.
    server_cpu_s: float | None = None
    event_loop_cpu_s: float | None = None
    # A forklift server's own account of the level's first tokens: the median of each
    # phase (ms) and of the steps a request waited (see forklift/engine/timelines.py).
    server_first_token: dict[str, float] | None = None

    @classmethod
    def of(cls, concurrency: int, wall_s: float, timings: list[RequestTiming]) -> LevelResult:
        done = [t for t in timings if t.ok]
        output_tokens = sum(t.output_tokens for t in done)
        itls = [gap for t in done for gap in t.itl_s]
        return cls(
            concurrency=concurrency,
            num_requests=len(timings),
            completed=len(done),
            wall_s=wall_s,
            output_tokens=output_tokens,
            output_tokens_per_s=output_tokens / wall_s,
            ttft_ms_p50=1000 * _percentile([t.ttft_s for t in done], 50),
            ttft_ms_p99=1000 * _percentile([t.ttft_s for t in done], 99),
            itl_ms_p50=1000 * _percentile(itls, 50),
            itl_ms_p99=1000 * _percentile(itls, 99),
            tpot_ms_mean=1000 * float(np.mean([t.tpot_s for t in done])) if done else 0.0,
            e2e_s_p50=_percentile([t.e2e_s for t in done], 50),
            e2e_s_p99=_percentile([t.e2e_s for t in done], 99),
            itl_ms_max=1000 * max(itls, default=0.0),
            prompt_tokens=sorted({t.prompt_tokens for t in done}),
            per_request_output_tokens=[t.output_tokens for t in done],
            errors=[t.error for t in timings if not t.ok],
        )


def run_serve_bench(settings: ServeSettings) -> dict[str, Any]:
    settings.validate()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    source = resolve_model(settings.model)
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError("the serving benchmark needs a model with a tokenizer for its prompts")
    if settings.base_url is None:
        server_args = (["--model", settings.model] if settings.model else []) + list(
            settings.server_args
        )
        server: Any = forklift_server_process(server_args)
    else:
        server = nullcontext((settings.base_url.rstrip("/").removesuffix("/v1"), None))
    with server as (base_url, pid):
        levels, served_model = asyncio.run(_sweep(settings, base_url, tokenizer, {}, pid))
    _scale(levels)
    report: dict[str, Any] = {
        "benchmark": "serve",
        "target": settings.base_url or "forklift serve (started by the benchmark)",
        "served_model": served_model,
        "tokenizer": source.path.name,
        "cpu_flags": cpu_flags(),
        "workload": {
            "endpoint": settings.endpoint,
            "input_tokens": settings.input_tokens,
            "output_tokens": settings.output_tokens,
            "ignore_eos": True,
            "concurrencies": list(settings.concurrencies),
            "requests_per_level": [settings.requests_at(c) for c in settings.concurrencies],
            "warmup_requests": settings.warmup_requests,
        },
        "levels": [asdict(level) for level in levels],
    }
    peer = _run_peer(settings, source, tokenizer)
    if peer is not None:
        report["peer"] = peer
        report["ratios"] = ratios(levels, [LevelResult(**lv) for lv in peer["levels"]])
    return report


def _scale(levels: list[LevelResult]) -> None:
    base = levels[0].output_tokens_per_s
    for level in levels:
        level.scaling = level.output_tokens_per_s / base if base > 0 else 0.0


def _run_peer(settings: ServeSettings, source: Any, tokenizer: Tokenizer) -> dict[str, Any] | None:
    if settings.peer_url:
        url = settings.peer_url.rstrip("/").removesuffix("/v1")
        name = "peer"
        server: Any = (
            shell_server_process(settings.peer_command, url)
            if settings.peer_command
            else nullcontext((url, None))
        )
        extra: dict[str, Any] = {}
    elif settings.llama_server:
        if source.format != "gguf":
            raise ValueError("--llama-server needs a GGUF model: it serves the same file")
        import torch

        threads = settings.peer_threads or torch.get_num_threads()
        name, server = "llama-server", llama_server_process(settings.llama_server, source.path,
                                                           threads)  # fmt: skip
        extra = {"cache_prompt": False}  # its prompt cache would answer from memory
    else:
        return None
    # The peer names its own model and takes no API key of forklift's.
    peer_settings = replace(settings, served_model=None, api_key=None)
    with server as (base_url, _):
        levels, served_model = asyncio.run(_sweep(peer_settings, base_url, tokenizer, extra, None))
    _scale(levels)
    return {
        "name": name,
        "target": settings.peer_url or "llama-server (started by the benchmark)",
        "started_after_forklift": bool(settings.peer_command or settings.llama_server),
        # llama-server names its model by the file's path: keep the file name only.
        "served_model": served_model.rsplit("/", 1)[-1],
        "levels": [asdict(level) for level in levels],
    }


def ratios(ours: list[LevelResult], peer: list[LevelResult]) -> list[dict[str, float]]:
    """Per concurrency: forklift over the peer for throughput, the peer over forklift for
    latencies, so above 1 always means forklift is better."""
    by_level = {lv.concurrency: lv for lv in peer}

    def inverse(theirs: float, mine: float) -> float:
        return theirs / mine if mine > 0 else 0.0

    rows = []
    for lv in ours:
        other = by_level.get(lv.concurrency)
        if other is None:
            continue
        rows.append({
            "concurrency": lv.concurrency,
            "output_tokens_per_s": inverse(lv.output_tokens_per_s, other.output_tokens_per_s),
            "ttft_p50": inverse(other.ttft_ms_p50, lv.ttft_ms_p50),
            "itl_p50": inverse(other.itl_ms_p50, lv.itl_ms_p50),
            "itl_p99": inverse(other.itl_ms_p99, lv.itl_ms_p99),
        })  # fmt: skip
    return rows


async def _sweep(
    settings: ServeSettings,
    base_url: str,
    tokenizer: Tokenizer,
    extra_body: dict[str, Any],
    server_pid: int | None,
) -> tuple[list[LevelResult], str]:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(max_connections=max(settings.concurrencies) + 4)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        served_model = settings.served_model or await _first_model(client)
        seed = 0

        def next_bodies(count: int, max_tokens: int) -> list[dict[str, Any]]:
            nonlocal seed
            prompts = [synthetic_prompt(tokenizer, settings.input_tokens, seed + i)
                       for i in range(count)]  # fmt: skip
            seed += count
            bodies = [request_body(settings.endpoint, served_model, p, max_tokens) for p in prompts]
            return [{**body, **extra_body} for body in bodies]

        warmup = await _run_level(client, settings.endpoint, 1, next_bodies(
            settings.warmup_requests, min(settings.output_tokens, 8)))  # fmt: skip
        if warmup[1] and not any(t.ok for t in warmup[1]):
            raise RuntimeError(f"warm-up requests failed: {warmup[1][0].error}")
        levels = []
        for concurrency in settings.concurrencies:
            bodies = next_bodies(settings.requests_at(concurrency), settings.output_tokens)
            before = _cpu_seconds(server_pid)
            level_start = time.time()
            wall_s, timings = await _run_level(client, settings.endpoint, concurrency, bodies)
            level = LevelResult.of(concurrency, wall_s, timings)
            level.server_first_token = await _first_token_medians(client, level_start)
            after = _cpu_seconds(server_pid)
            if before is not None and after is not None:
                level.server_cpu_s = after[0] - before[0]
                level.event_loop_cpu_s = after[1] - before[1]
            levels.append(level)
    return levels, served_model


def _cpu_seconds(pid: int | None) -> tuple[float, float] | None:
    """(whole process, its event-loop thread) CPU seconds. `forklift serve` names that
    thread (the engine loop has the main thread); a server that does not is read by its
    main thread."""
    if pid is None:
        return None
    import psutil

    from forklift.server.run_server import HTTP_THREAD_NAME

    try:
        process = psutil.Process(pid)
        threads = {t.id: t.user_time + t.system_time for t in process.threads()}
    except psutil.Error:
        return None
    loop = next((tid for tid in threads if _thread_name(pid, tid) == HTTP_THREAD_NAME), pid)
    return sum(threads.values()), threads.get(loop, 0.0)


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


async def _first_token_medians(client: httpx.AsyncClient, since: float) -> dict[str, float] | None:
    """Medians of the server's first-token phases for requests since `since`; None for a
    server that does not keep timelines (a peer)."""
    from forklift.server.status.page import FIRST_TOKEN_JSON_PATH

    response = await client.get(FIRST_TOKEN_JSON_PATH, params={"since": since})
    if response.status_code != 200:
        return None
    timelines = response.json().get("timelines") or []
    if not timelines:
        return None
    keys = [k for k in timelines[0] if k.endswith("_ms") or k == "steps_waited"]
    return {k: float(np.median([t[k] for t in timelines if k in t])) for k in keys}


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("the server lists no models; pass --served-model")
    return models[0]["id"]


async def _run_level(
    client: httpx.AsyncClient, endpoint: str, concurrency: int, bodies: list[dict[str, Any]]
) -> tuple[float, list[RequestTiming]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> RequestTiming:
        async with gate:
            return await stream_request(client, endpoint, body)

    start = time.perf_counter()
    timings = await asyncio.gather(*(one(body) for body in bodies))
    return time.perf_counter() - start, list(timings)


def render_markdown(report: dict[str, Any]) -> str:
    work = report["workload"]
    lines = [
        "# Serving sweep: streaming load against an OpenAI-compatible server",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Target: {report['target']}, model `{report['served_model']}`, endpoint "
        f"`{work['endpoint']}`. Each request: {work['input_tokens']} prompt tokens (synthetic, "
        f"counted with the {report['tokenizer']} tokenizer), {work['output_tokens']} output "
        f"tokens with `ignore_eos`, streamed. {work['warmup_requests']} warm-up requests first.",
        "",
        "| concurrency | requests | output tok/s | scaling vs c=1 | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | ITL p99 (ms) | TPOT (ms) | e2e p50 (s) | e2e p99 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in report["levels"]:
        done = f"{lv['completed']}/{lv['num_requests']}"
        lines.append(
            f"| {lv['concurrency']} | {done} | {lv['output_tokens_per_s']:.1f} | "
            f"{lv['scaling']:.2f}x | {lv['ttft_ms_p50']:.0f} | {lv['ttft_ms_p99']:.0f} | "
            f"{lv['itl_ms_p50']:.0f} | {lv['itl_ms_p99']:.0f} | {lv['tpot_ms_mean']:.0f} | "
            f"{lv['e2e_s_p50']:.1f} | {lv['e2e_s_p99']:.1f} |"
        )
    lines += _cpu_lines(report["levels"])
    lines += _first_token_lines(report["levels"])
    if "peer" in report:
        lines += _peer_lines(report)
    peer_levels = report.get("peer", {}).get("levels", [])
    errors = [e for lv in report["levels"] + peer_levels for e in lv["errors"]]
    if errors:
        lines += ["", f"{len(errors)} requests failed; first error: {errors[0]}"]
    if report.get("cpu_flags"):
        lines += ["", f"CPU flags: {' '.join(report['cpu_flags'])}."]
    lines.append("")
    return "\n".join(lines)


def _first_token_lines(levels: list[dict[str, Any]]) -> list[str]:
    known = [lv for lv in levels if lv.get("server_first_token")]
    if not known:
        return []
    lines = [
        "",
        "Where the first token's time went, by the server's timelines (medians, ms): the "
        "request reaching the engine (tokenized, queued), waiting for a step, earlier prefill "
        "chunks, the step that samples it, delivery to the event loop; and the steps waited.",
        "",
        "| concurrency | to engine | waiting | steps waited | prefill | last step | delivery "
        "| server TTFT | client TTFT p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in known:
        ft = lv["server_first_token"]
        cells = [f"{ft.get(k, float('nan')):.0f}" for k in ("to_engine_ms", "waiting_ms")]
        cells.append(f"{ft.get('steps_waited', float('nan')):.0f}")
        cells += [
            f"{ft.get(k, float('nan')):.0f}"
            for k in ("prefill_ms", "last_step_ms", "delivery_ms", "ttft_ms")
        ]
        lines.append(f"| {lv['concurrency']} | {' | '.join(cells)} | {lv['ttft_ms_p50']:.0f} |")
    return lines


def _cpu_lines(levels: list[dict[str, Any]]) -> list[str]:
    if not levels or levels[0].get("server_cpu_s") is None:
        return []
    lines = [
        "",
        "forklift's CPU time per level (the event-loop thread parses HTTP, builds JSON and "
        "frames SSE; the rest is the engine thread, the model's threads and tokenizing):",
        "",
        "| concurrency | wall (s) | process CPU (s) | event loop CPU (s) | event loop share |",
        "|---|---|---|---|---|",
    ]
    for lv in levels:
        total, loop = lv["server_cpu_s"], lv["event_loop_cpu_s"]
        share = loop / total if total else 0.0
        lines.append(
            f"| {lv['concurrency']} | {lv['wall_s']:.1f} | {total:.1f} | {loop:.2f} | "
            f"{100 * share:.1f}% |"
        )
    return lines


def _peer_lines(report: dict[str, Any]) -> list[str]:
    peer = report["peer"]
    name = peer["name"]
    lines = [
        "",
        f"## Side by side: forklift vs {name} ({peer['target']}, model `{peer['served_model']}`)",
        "",
        "Ratios: throughput forklift / peer, latencies peer / forklift (above 1: forklift is "
        "better).",
        *(
            [
                "",
                f"The {name} started after forklift's sweep ended and stopped after its own: "
                "each server had the machine and its memory to itself.",
            ]
            if peer.get("started_after_forklift")
            else []
        ),
        "",
        f"| concurrency | forklift out tok/s | {name} out tok/s | ratio | TTFT p50 forklift / "
        f"{name} (ms) | TTFT p99 forklift / {name} (ms) | ITL p50 forklift / {name} (ms) | "
        f"ITL p99 forklift / {name} (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    theirs = {lv["concurrency"]: lv for lv in peer["levels"]}
    ratio = {r["concurrency"]: r for r in report["ratios"]}
    for lv in report["levels"]:
        other, r = theirs.get(lv["concurrency"]), ratio.get(lv["concurrency"])
        if other is None or r is None:
            continue
        lines.append(
            f"| {lv['concurrency']} | {lv['output_tokens_per_s']:.1f} | "
            f"{other['output_tokens_per_s']:.1f} | {r['output_tokens_per_s']:.2f}x | "
            f"{lv['ttft_ms_p50']:.0f} / {other['ttft_ms_p50']:.0f} | "
            f"{lv['ttft_ms_p99']:.0f} / {other['ttft_ms_p99']:.0f} | "
            f"{lv['itl_ms_p50']:.0f} / {other['itl_ms_p50']:.0f} | "
            f"{lv['itl_ms_p99']:.0f} / {other['itl_ms_p99']:.0f} |"
        )
    return lines


def write_report(report: dict[str, Any], out_dir: Path, name: str = "serve") -> list[Path]:
    return write_report_files(report, out_dir, name, render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    levels = report["levels"]
    conc = [lv["concurrency"] for lv in levels]
    fig, (left, right) = subplots(1, 2, figsize=(10, 4))
    left.plot(conc, [lv["output_tokens_per_s"] for lv in levels], "o-", color="#2a7ab0")
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens / s")
    left.set_title("Throughput")
    right.plot(conc, [lv["ttft_ms_p50"] / 1000 for lv in levels], "o-", label="p50")
    right.plot(conc, [lv["ttft_ms_p99"] / 1000 for lv in levels], "s--", label="p99")
    right.set_xlabel("concurrency")
    right.set_ylabel("time to first token (s)")
    right.set_title("TTFT")
    right.legend()
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(conc, [str(c) for c in conc])
    return fig
