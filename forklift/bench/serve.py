"""`forklift bench serve`: a streaming load sweep against an OpenAI-compatible server.

Each concurrency level sends its requests through a semaphore of that size, so exactly
`concurrency` requests are in flight until the queue drains. Prompts are synthetic text of
an exact token count, unique per request, and every request asks for a fixed number of
output tokens with `ignore_eos`, like the seed's serving table.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from forklift.bench.report import write_report_files
from forklift.bench.server_process import forklift_server
from forklift.bench.stream_client import RequestTiming, request_body, stream_request
from forklift.bench.synthetic_prompt import synthetic_prompt
from forklift.model.model_source import resolve_model
from forklift.tokenizer import Tokenizer, load_tokenizer


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

    @classmethod
    def quick(cls, **overrides: Any) -> ServeSettings:
        return cls(**{"input_tokens": 128, "output_tokens": 16, "concurrencies": (1, 4),
                      "min_requests": 4, "requests_per_concurrency": 1,
                      "warmup_requests": 1, **overrides})  # fmt: skip

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_concurrency * concurrency)

    def validate(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")


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
    prompt_tokens: list[int]
    per_request_output_tokens: list[int]
    errors: list[str]
    scaling: float = 0.0  # output tok/s relative to the lowest concurrency level

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
        server = forklift_server(server_args)
    else:
        server = nullcontext(settings.base_url.rstrip("/").removesuffix("/v1"))
    with server as base_url:
        levels, served_model = asyncio.run(_sweep(settings, base_url, tokenizer))
    base = levels[0].output_tokens_per_s
    for level in levels:
        level.scaling = level.output_tokens_per_s / base if base > 0 else 0.0
    return {
        "benchmark": "serve",
        "target": settings.base_url or "forklift serve (started by the benchmark)",
        "served_model": served_model,
        "tokenizer": source.path.name,
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


async def _sweep(
    settings: ServeSettings, base_url: str, tokenizer: Tokenizer
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
            return [request_body(settings.endpoint, served_model, p, max_tokens) for p in prompts]

        warmup = await _run_level(client, settings.endpoint, 1, next_bodies(
            settings.warmup_requests, min(settings.output_tokens, 8)))  # fmt: skip
        if warmup[1] and not any(t.ok for t in warmup[1]):
            raise RuntimeError(f"warm-up requests failed: {warmup[1][0].error}")
        levels = []
        for concurrency in settings.concurrencies:
            bodies = next_bodies(settings.requests_at(concurrency), settings.output_tokens)
            wall_s, timings = await _run_level(client, settings.endpoint, concurrency, bodies)
            levels.append(LevelResult.of(concurrency, wall_s, timings))
    return levels, served_model


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
    errors = [e for lv in report["levels"] for e in lv["errors"]]
    if errors:
        lines += ["", f"{len(errors)} requests failed; first error: {errors[0]}"]
    lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, name: str = "serve") -> list[Path]:
    return write_report_files(report, out_dir, name, render_markdown, _plot)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    conc = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
