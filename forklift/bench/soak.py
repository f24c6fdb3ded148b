"""`forklift bench soak`: many mixed requests against `forklift serve`, a share of them
dropped mid-stream, checking that nothing leaks.

Requests cycle through completions and chat, streaming and not, n of 1 or 2, with and
without logprobs, each with `ignore_eos` and a fixed `max_tokens`, so every answer's length
is known. Streams picked for a disconnect are closed after their first content chunk. While
the load runs, the server's resident memory and KV usage are sampled. Afterwards the server
must be idle with no KV block in use, every completed request must have exactly the tokens
it asked for, and nothing may have failed.

The server gets a KV cache of its own size (`kv_cache_blocks`, 768 blocks of 16 tokens by
default, whatever the model's dtype):
its blocks are `torch.empty` pages touched on first use, and the free list hands out the
least recently used block, so a cache sized from RAM (gigabytes) would keep adding resident
memory until every block had been used once, which looks like a leak and is not one. With a
bounded cache every block is touched during warm-up, and growth after it is a real leak.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

from forklift.bench.report import cpu_flags, subplots, write_report_files
from forklift.bench.server_process import forklift_server_process
from forklift.bench.stream_client import sse_payloads

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class SoakSettings:
    model: str | None = None
    num_requests: int = 10_000
    concurrency: int = 16
    # Share of streaming requests closed by the client after their first chunk.
    disconnect_share: float = 0.2
    max_tokens: tuple[int, ...] = (2, 4, 8)
    sample_every_s: float = 5.0
    # Enough for a request of the default model's whole context (512 blocks) in any dtype.
    kv_cache_blocks: int = 768

    @classmethod
    def quick(cls, **overrides: Any) -> SoakSettings:
        return cls(**{"num_requests": 48, "concurrency": 8, "sample_every_s": 1.0,
                      **overrides})  # fmt: skip

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.concurrency < 1:
            raise ValueError("num_requests and concurrency must be positive")
        if not 0 <= self.disconnect_share <= 1:
            raise ValueError(f"disconnect_share must be in [0, 1], got {self.disconnect_share}")


@dataclass(frozen=True)
class SoakRequest:
    """One request of the mix; `disconnect` closes its stream after the first chunk."""

    index: int
    endpoint: str  # "completions" or "chat"
    stream: bool
    n: int
    logprobs: bool
    max_tokens: int
    disconnect: bool

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "soak",
            "max_tokens": self.max_tokens,
            "n": self.n,
            "temperature": 0.8,
            "seed": self.index,
            "ignore_eos": True,
            "stream": self.stream,
        }
        text = f"Request {self.index}: say something about the number {self.index % 97}."
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            if self.logprobs:
                body |= {"logprobs": True, "top_logprobs": 2}
        else:
            body["prompt"] = text
            if self.logprobs:
                body["logprobs"] = 2
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def request_mix(settings: SoakSettings) -> list[SoakRequest]:
    mix = []
    share = settings.disconnect_share
    for index in range(settings.num_requests):
        stream = index % 2 == 0
        # Spread the disconnects evenly: stream j drops when j * share crosses an integer.
        j = index // 2
        mix.append(
            SoakRequest(
                index=index,
                endpoint=("completions", "chat")[(index // 2) % 2],
                stream=stream,
                n=1 + (index // 4) % 2,
                logprobs=(index // 8) % 2 == 1,
                max_tokens=settings.max_tokens[index % len(settings.max_tokens)],
                disconnect=stream and int((j + 1) * share) > int(j * share),
            )  # fmt: skip
        )
    return mix


@dataclass
class Outcome:
    ok: bool
    disconnected: bool = False
    error: str = ""


async def run_request(client: httpx.AsyncClient, request: SoakRequest) -> Outcome:
    path = "/v1/chat/completions" if request.endpoint == "chat" else "/v1/completions"
    try:
        if not request.stream:
            response = await client.post(path, json=request.body())
            if response.status_code != 200:
                return Outcome(False, error=f"HTTP {response.status_code}: {response.text[:200]}")
            return _check_lengths(request, response.json())
        async with client.stream("POST", path, json=request.body()) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return Outcome(False, error=f"HTTP {response.status_code}: {detail}")
            return await _read_stream(request, response)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}")


async def _read_stream(request: SoakRequest, response: httpx.Response) -> Outcome:
    finished: dict[int, str] = {}
    usage: dict[str, Any] = {}
    async for chunk in sse_payloads(response):
        if request.disconnect and chunk.get("choices"):
            return Outcome(True, disconnected=True)  # leaving the block closes the stream
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason"):
                finished[choice["index"]] = choice["finish_reason"]
        usage = chunk.get("usage") or usage
    return _check_usage(request, usage, finished)


def _check_lengths(request: SoakRequest, body: dict[str, Any]) -> Outcome:
    finished = {c["index"]: c["finish_reason"] for c in body.get("choices", [])}
    return _check_usage(request, body.get("usage") or {}, finished)


def _check_usage(request: SoakRequest, usage: dict[str, Any], finished: dict[int, str]) -> Outcome:
    want = request.n * request.max_tokens
    if usage.get("completion_tokens") != want:
        return Outcome(False, error=f"{usage.get('completion_tokens')} tokens, expected {want}")
    if finished != dict.fromkeys(range(request.n), "length"):
        return Outcome(False, error=f"finish reasons {finished}, expected 'length' x{request.n}")
    return Outcome(True)


@dataclass
class MemorySample:
    elapsed_s: float
    completed: int
    rss_mib: float
    kv_usage: float


async def server_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    gauges = {}
    for line in text.splitlines():
        if line.startswith("forklift:") and " " in line:
            name, value = line.rsplit(" ", 1)
            gauges[name.split("{")[0]] = float(value)
    return gauges


async def _sample_memory(
    client: httpx.AsyncClient, pid: int, every_s: float, outcomes: list[Outcome],
    samples: list[MemorySample], start: float,
) -> None:  # fmt: skip
    process = psutil.Process(pid)
    while True:
        gauges = await server_gauges(client)
        samples.append(
            MemorySample(
                time.perf_counter() - start,
                len(outcomes),
                process.memory_info().rss / 2**20,
                gauges.get("forklift:kv_cache_usage_perc", float("nan")),
            )  # fmt: skip
        )
        await asyncio.sleep(every_s)


async def _drive(base_url: str, pid: int, settings: SoakSettings) -> dict[str, Any]:
    mix = request_mix(settings)
    outcomes: list[Outcome] = []
    samples: list[MemorySample] = []
    queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
    for request in mix:
        queue.put_nowait(request)
    limits = httpx.Limits(max_connections=settings.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                outcomes.append(await run_request(client, queue.get_nowait()))

        start = time.perf_counter()
        sampler = asyncio.create_task(
            _sample_memory(client, pid, settings.sample_every_s, outcomes, samples, start)
        )
        await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
        wall = time.perf_counter() - start
        idle = await _wait_idle(client)
        sampler.cancel()
        final = await server_gauges(client)
        rss_end = psutil.Process(pid).memory_info().rss / 2**20
    errors = [o.error for o in outcomes if not o.ok]
    return {
        "requests": len(outcomes),
        "disconnects": sum(o.disconnected for o in outcomes),
        "errors": len(errors),
        "first_errors": errors[:5],
        "wall_s": wall,
        "requests_per_s": len(outcomes) / wall,
        "idle_after_s": idle,
        "final_kv_usage": final.get("forklift:kv_cache_usage_perc", float("nan")),
        "final_running": final.get("forklift:num_requests_running", float("nan")),
        "final_waiting": final.get("forklift:num_requests_waiting", float("nan")),
        "rss_end_mib": rss_end,
        "samples": [asdict(s) for s in samples],
    }


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> float:
    """Seconds until the server runs, queues and holds nothing (dropped streams are aborted
    at the next step)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        gauges = await server_gauges(client)
        busy = gauges.get("forklift:num_requests_running", 0) + gauges.get(
            "forklift:num_requests_waiting", 0
        )
        if busy == 0 and gauges.get("forklift:kv_cache_usage_perc", 0) == 0:
            break
        await asyncio.sleep(0.2)
    return time.perf_counter() - start


def rss_growth_after_warmup(samples: list[dict[str, Any]], warmup_share: float = 0.2) -> float:
    """MiB of resident memory gained between the end of warm-up (the first 20% of samples)
    and the end: a leak grows with the requests served, a cache stops growing."""
    if len(samples) < 2:
        return 0.0
    after = samples[max(1, int(len(samples) * warmup_share)) :]
    return max(s["rss_mib"] for s in after[-max(1, len(after) // 5) :]) - after[0]["rss_mib"]


def run_soak(settings: SoakSettings) -> dict[str, Any]:
    args = ["--served-model-name", "soak"]
    args += ["--num-gpu-blocks-override", str(settings.kv_cache_blocks)]
    args += ["--model", settings.model] if settings.model else []
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    with forklift_server_process(args) as (base_url, pid):
        result = asyncio.run(_drive(base_url, pid, settings))
    result["rss_growth_after_warmup_mib"] = rss_growth_after_warmup(result["samples"])
    return {
        "benchmark": "soak",
        "cpu_flags": cpu_flags(),
        "settings": asdict(settings),
        **result,
    }


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    samples = report["samples"]
    lines = [
        "# Soak: mixed requests and dropped streams against `forklift serve`",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{s['num_requests']} requests at concurrency {s['concurrency']}: completions and chat, "
        f"streaming and not, n 1 or 2, with and without logprobs, max_tokens "
        f"{', '.join(map(str, s['max_tokens']))} (`ignore_eos`); "
        f"{100 * s['disconnect_share']:.0f}% of the streams closed by the client after their "
        f"first chunk. The server's KV cache: {s['kv_cache_blocks']} blocks. "
        f"CPU flags: "
        f"{' '.join(report['cpu_flags']) or 'n/a'}.",
        "",
        "| requests | disconnects | errors | req/s | idle after (s) | KV usage after | "
        "RSS start / end (MiB) | RSS growth after warm-up (MiB) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {report['requests']} | {report['disconnects']} | {report['errors']} | "
        f"{report['requests_per_s']:.1f} | {report['idle_after_s']:.1f} | "
        f"{report['final_kv_usage']:.3f} | "
        f"{samples[0]['rss_mib'] if samples else float('nan'):.0f} / {report['rss_end_mib']:.0f} | "
        f"{report['rss_growth_after_warmup_mib']:.1f} |",
        "",
    ]
    if report["first_errors"]:
        lines += ["First errors:", ""] + [f"- `{e}`" for e in report["first_errors"]] + [""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "soak", render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    samples = report["samples"]
    fig, axis = subplots(figsize=(7, 4))
    axis.plot([s["completed"] for s in samples], [s["rss_mib"] for s in samples], "o-", ms=3)
    axis.set_xlabel("requests completed")
    axis.set_ylabel("server resident memory (MiB)")
    axis.set_title(f"Soak: {report['requests']} requests, {report['disconnects']} dropped")
    return fig
