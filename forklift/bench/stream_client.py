"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestTiming:
    """What one streamed request measured; times in seconds from its send."""

    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    # Gaps between successive content chunks (one token per chunk on most servers).
    itl_s: list[float] = field(default_factory=list)
    # llama-server's own per-request counters (its streams' `timings`; {} elsewhere).
    server_timings: dict[str, Any] = field(default_factory=dict)

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, the usual definition."""
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    elif endpoint == "completions":
        body["prompt"] = prompt
    else:
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def sse_payloads(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent-event stream, up to its `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_request(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]
) -> RequestTiming:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestTiming(ok=False, error=f"HTTP {response.status_code}: {detail}")
            async for chunk in sse_payloads(response):
                if _chunk_text(chunk):
                    chunk_times.append(time.perf_counter() - start)
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestTiming(ok=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter() - start
    if not chunk_times:
        return RequestTiming(ok=False, error="the stream carried no tokens")
    return RequestTiming(
        ok=True,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        # Servers without usage in streams: count content chunks instead.
        output_tokens=int(usage.get("completion_tokens", len(chunk_times))),
        ttft_s=chunk_times[0],
        e2e_s=end,
        itl_s=[b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
        server_timings=timings,
    )
