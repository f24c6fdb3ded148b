"""`forklift bench prefix`: what prefix caching and block-sharing parallel sampling buy.

(a) Requests that share a long system prompt, with prefix caching on vs off: time to first
token and output throughput, plus the cache's hit counters.
(b) A GRPO-style group, prompts x `n` samples, vs the same samples sent as independent
requests: peak KV blocks in use and output throughput.
Both parts run every side in one process on the same model, one engine per side.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forklift.bench.report import subplots, write_report_files
from forklift.bench.workload import INSTRUCTIONS
from forklift.engine.engine import LLMEngine, sample_seed
from forklift.llm import LLM
from forklift.outputs import RequestOutput
from forklift.sampling_params import SamplingParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_SYSTEM_SENTENCE = (
    "You are the support assistant of a small bicycle shop; answer briefly, politely and "
    "only about repairs, parts, rentals and opening hours. "
)


@dataclass
class PrefixSettings:
    model: str | None = None
    dtype: str = "auto"
    shared_requests: int = 32
    system_prompt_tokens: int = 500
    shared_output_tokens: int = 32
    group_prompts: int = 8
    group_n: int = 8
    group_output_tokens: int = 64
    max_model_len: int = 1024

    @classmethod
    def quick(cls, **overrides: Any) -> PrefixSettings:
        return cls(**{"shared_requests": 6, "system_prompt_tokens": 160,
                      "shared_output_tokens": 8, "group_prompts": 2, "group_n": 4,
                      "group_output_tokens": 8, "max_model_len": 512, **overrides})  # fmt: skip


@dataclass
class RunResult:
    label: str
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_s_mean: float
    ttft_s_p50: float
    peak_blocks: int
    cached_prompt_tokens: int
    prompt_tokens: int
    per_request_output_tokens: list[int]


def _run(
    engine: LLMEngine,
    label: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    first_alone: bool = False,
) -> RunResult:
    """Submit the requests and step to the end, sampling block usage after every step.

    With `first_alone`, the first request arrives one step before the others (long enough
    to compute its prompt), like a stream of requests that share a system prompt; otherwise
    all arrive at once.
    """
    stats_before = engine.stats().prefix_cache
    start = time.perf_counter()
    finals: dict[str, RequestOutput] = {}
    peak = 0

    def step() -> None:
        nonlocal peak
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        counters = engine.stats()
        peak = max(peak, counters.num_usable_blocks - counters.num_free_blocks)

    queue = list(enumerate(zip(prompts, params, strict=True)))
    waves = [queue[:1], queue[1:]] if first_alone else [queue]
    for wave in waves:
        arrival = time.time()
        for index, (prompt, p) in wave:
            engine.add_request(f"{label}-{index}", prompt, p, arrival_time=arrival)
        step()
    while engine.has_unfinished_requests():
        step()
    wall = time.perf_counter() - start
    outputs = [finals[f"{label}-{i}"] for i in range(len(prompts))]
    produced = [len(c.token_ids) for o in outputs for c in o.outputs]
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    stats = engine.stats().prefix_cache
    return RunResult(
        label=label,
        wall_s=wall,
        output_tokens=sum(produced),
        output_tokens_per_s=sum(produced) / wall,
        ttft_s_mean=statistics.fmean(ttfts),
        ttft_s_p50=statistics.median(ttfts),
        peak_blocks=peak,
        cached_prompt_tokens=stats.hit_tokens - stats_before.hit_tokens,
        prompt_tokens=sum(len(p) for p in prompts),
        per_request_output_tokens=produced,
    )


def _system_prompt(llm: LLM, num_tokens: int) -> str:
    tokenizer = llm.get_tokenizer()
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += _SYSTEM_SENTENCE
    return text


def _chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    return llm.get_tokenizer().encode_chat(messages)


def run_prefix_bench(settings: PrefixSettings) -> dict[str, Any]:
    def make(enable_prefix_caching: bool) -> LLM:
        return LLM(
            model=settings.model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )

    cached, plain = make(True), make(False)
    for llm in (cached, plain):  # one-time costs outside the timed runs
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.reset_prefix_cache()
    system = _system_prompt(cached, settings.system_prompt_tokens)
    shared_prompts = [
        _chat_ids(cached, [{"role": "system", "content": system},
                           {"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)]}])
        for i in range(settings.shared_requests)
    ]  # fmt: skip
    shared_params = [
        SamplingParams(temperature=0, max_tokens=settings.shared_output_tokens, ignore_eos=True)
    ] * len(shared_prompts)
    shared = [
        _run(plain.llm_engine, "caching-off", shared_prompts, shared_params, first_alone=True),
        _run(cached.llm_engine, "caching-on", shared_prompts, shared_params, first_alone=True),
    ]

    group_prompts = [
        _chat_ids(cached, [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)]}])
        for i in range(settings.group_prompts)
    ]
    n, length = settings.group_n, settings.group_output_tokens
    group_params = [
        SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=length, ignore_eos=True)
        for i in range(len(group_prompts))
    ]
    # The same samples, one request each, seeded as the group's samples are.
    solo_prompts = [p for p in group_prompts for _ in range(n)]
    solo_params = [
        p.clone(n=1, seed=sample_seed(p.seed, i)) for p in group_params for i in range(n)
    ]
    plain.reset_prefix_cache()
    cached.reset_prefix_cache()
    group = [
        _run(plain.llm_engine, "independent", solo_prompts, solo_params),
        _run(plain.llm_engine, f"n={n} group", group_prompts, group_params),
        _run(cached.llm_engine, "independent + prefix caching", solo_prompts, solo_params),
    ]
    off, on = shared
    return {
        "benchmark": "prefix",
        "model": str(cached.llm_engine.model_source.path.name),
        "dtype": str(cached.llm_engine.dtype).removeprefix("torch."),
        "settings": asdict(settings),
        "shared_prompt_tokens": [len(p) for p in shared_prompts],
        "shared": [asdict(r) for r in shared],
        "shared_speedup": on.output_tokens_per_s / off.output_tokens_per_s,
        "shared_ttft_ratio": off.ttft_s_mean / on.ttft_s_mean,
        "group": [asdict(r) for r in group],
        "group_block_ratio": group[0].peak_blocks / group[1].peak_blocks,
        "group_speedup": group[1].output_tokens_per_s / group[0].output_tokens_per_s,
    }


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Prefix caching and parallel sampling",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model {report['model']}, dtype {report['dtype']}; each side is its own engine in "
        "one process. In (a) the first request arrives one engine step before the others "
        "(a stream of requests behind one system prompt); in (b) all arrive at once. "
        "TTFT counts from each request's arrival.",
        "",
        f"## (a) {s['shared_requests']} requests sharing a {s['system_prompt_tokens']}-token "
        f"system prompt, {s['shared_output_tokens']} output tokens each",
        "",
        "| prefix caching | prompt tokens | cached | TTFT mean (s) | TTFT p50 (s) | wall (s) "
        "| output tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["shared"]:
        lines.append(
            f"| {r['label'].removeprefix('caching-')} | {r['prompt_tokens']} | "
            f"{r['cached_prompt_tokens']} | {r['ttft_s_mean']:.2f} | {r['ttft_s_p50']:.2f} | "
            f"{r['wall_s']:.1f} | {r['output_tokens_per_s']:.1f} |"
        )
    lines += [
        "",
        f"Caching on vs off: **{report['shared_speedup']:.2f}x** output throughput, "
        f"**{report['shared_ttft_ratio']:.2f}x** lower mean time to first token.",
        "",
        f"## (b) GRPO group: {s['group_prompts']} prompts x n={s['group_n']}, "
        f"{s['group_output_tokens']} output tokens per sample",
        "",
        "| requests | samples | peak KV blocks | cached prompt tokens | wall (s) | output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["group"]:
        lines.append(
            f"| {r['label']} | {len(r['per_request_output_tokens'])} | {r['peak_blocks']} | "
            f"{r['cached_prompt_tokens']} | {r['wall_s']:.1f} | {r['output_tokens_per_s']:.1f} |"
        )
    lines += [
        "",
        f"The group holds **{report['group_block_ratio']:.2f}x** fewer KV blocks at its peak "
        f"than independent requests, at {report['group_speedup']:.2f}x their throughput. "
        "Independent copies of one prompt that arrive together all miss the prefix cache "
        "(none is computed yet when they are admitted); `n` shares the prompt regardless.",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "prefix", render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    fig, (left, right) = subplots(1, 2, figsize=(11, 4))
    shared = report["shared"]
    left.bar([r["label"] for r in shared], [r["ttft_s_mean"] for r in shared],
             color=["#999999", "#2a7ab0"])  # fmt: skip
    left.set_ylabel("mean time to first token (s)")
    left.set_title(f"(a) shared system prompt: {report['shared_ttft_ratio']:.1f}x lower TTFT")
    group = report["group"]
    right.bar([r["label"] for r in group], [r["peak_blocks"] for r in group],
              color=["#999999", "#2a7ab0", "#7fb3d5"])  # fmt: skip
    right.set_ylabel("peak KV blocks in use")
    right.set_title(f"(b) GRPO group: {report['group_block_ratio']:.1f}x fewer blocks")
    right.tick_params(axis="x", labelsize=8)
    return fig
