"""`forklift bench scale`: TP=2 and DP=2 against one engine on this machine, plus the arithmetic
of tensor parallelism's all-reduces over NVLink versus an ordinary network.

Measured part: the same streaming workload (bench serve's client) against `forklift serve`
with one engine, with `--tensor-parallel-size 2`, and with `--data-parallel-size 2`, in one
run. The machine's cores are split between the ranks or replicas, so on a 2-core CPU each
of the two processes gets one thread.

Arithmetic part: a tensor-parallel decode step all-reduces the hidden state twice per layer
(after attention and after the MLP). A ring all-reduce over N ranks takes 2(N-1) steps, each
moving 1/N of the message and paying the link's latency once.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forklift.bench.report import subplots, write_report_files
from forklift.bench.serve import ServeSettings, run_serve_bench

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    note: str


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_bytes_per_s: float  # per direction, per rank
    latency_s: float  # per message step
    note: str


MODELS = (
    ModelShape("SmolLM2-135M (default model)", 576, 30, "from its GGUF metadata"),
    ModelShape(
        "27B-class example", 5120, 64,
        "assumed: a Qwen3-27B-class dense shape (hidden 5120, 64 layers)",
    ),
)  # fmt: skip
LINKS = (
    Link("NVLink (H100, NVLink 4)", 450e9, 5e-6, "450 GB/s per direction; ~5 us per step"),
    Link("ordinary network (25 GbE, TCP)", 25e9 / 8, 50e-6, "3.1 GB/s; ~50 us per step"),
)
BF16_BYTES = 2


def allreduce_seconds(message_bytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, 2(N-1) steps of message/N each."""
    if ranks < 2:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * (link.latency_s + message_bytes / ranks / link.bandwidth_bytes_per_s)


def tp_step_comm(model: ModelShape, link: Link, batch: int, ranks: int = 2) -> dict[str, Any]:
    """All-reduce traffic and time of one decode step of `batch` tokens."""
    allreduces = 2 * model.num_layers
    message = batch * model.hidden_size * BF16_BYTES
    per_allreduce = allreduce_seconds(message, ranks, link)
    sent_per_rank = allreduces * 2 * (ranks - 1) * message / ranks
    return {
        "model": model.name,
        "link": link.name,
        "batch": batch,
        "allreduces_per_step": allreduces,
        "message_bytes": message,
        "bytes_sent_per_rank_per_token": sent_per_rank / batch,
        "allreduce_us": 1e6 * per_allreduce,
        "step_comm_ms": 1e3 * allreduces * per_allreduce,
    }


@dataclass
class ScaleSettings:
    model: str | None = None
    input_tokens: int = 128
    output_tokens: int = 64
    concurrencies: tuple[int, ...] = (1, 8)
    requests_per_concurrency: int = 2
    min_requests: int = 4


# (label, processes, extra `forklift serve` arguments)
DEPLOYMENTS = (
    ("one engine (TP=1, DP=1)", 1, []),
    ("TP=2", 2, ["--tensor-parallel-size", "2"]),
    ("DP=2 (Ray)", 2, ["--data-parallel-size", "2"]),
)


def run_scale_bench(settings: ScaleSettings) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    measured = []
    for label, processes, args in DEPLOYMENTS:
        serve = ServeSettings(
            model=settings.model,
            input_tokens=settings.input_tokens,
            output_tokens=settings.output_tokens,
            concurrencies=settings.concurrencies,
            requests_per_concurrency=settings.requests_per_concurrency,
            min_requests=settings.min_requests,
            server_args=list(args),
        )
        report = run_serve_bench(serve)
        measured.append({
            "deployment": label,
            "processes": processes,
            "threads_per_process": max(1, cores // processes),
            "levels": report["levels"],
        })  # fmt: skip
    return {
        "benchmark": "scale",
        "cores": cores,
        "settings": asdict(settings),
        "measured": measured,
        "tp_comm": [
            tp_step_comm(m, link, batch) for m in MODELS for link in LINKS for batch in (1, 8)
        ],  # fmt: skip
        "models": [asdict(m) for m in MODELS],
        "links": [asdict(link) for link in LINKS],
    }


def _level(deployment: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    return next((lv for lv in deployment["levels"] if lv["concurrency"] == concurrency), None)


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    top = max(s["concurrencies"])
    base = _level(report["measured"][0], top)
    lines = [
        "# Scale: tensor parallelism vs data parallelism",
        "",
        f"Command: `{report['command']}`",
        "",
        f"## Measured on this machine ({report['cores']} cores)",
        "",
        f"Streaming completions, {s['input_tokens']} prompt tokens, {s['output_tokens']} "
        f"output tokens (ignore_eos), bench serve's client; the cores are split between "
        "processes. With few cores there is no idle compute for TP to add: it halves each "
        "matmul but adds two gloo all-reduces per layer and a broadcast of every step's "
        "inputs; DP replicas share nothing but the cores.",
        "",
        "| deployment | processes x threads | " + " | ".join(
            f"c={c} tok/s" for c in s["concurrencies"]) + f" | c={top} TTFT p50 (ms) "
        f"| c={top} vs one engine |",
        "|---|---|" + "---|" * len(s["concurrencies"]) + "---|---|",
    ]  # fmt: skip
    for deployment in report["measured"]:
        cells = []
        for c in s["concurrencies"]:
            level = _level(deployment, c)
            cells.append(f"{level['output_tokens_per_s']:.1f}" if level else "-")
        level = _level(deployment, top)
        ratio = (
            level["output_tokens_per_s"] / base["output_tokens_per_s"]
            if level and base and base["output_tokens_per_s"] > 0
            else 0.0
        )
        ttft = f"{level['ttft_ms_p50']:.0f}" if level else "-"
        lines.append(
            f"| {deployment['deployment']} | {deployment['processes']} x "
            f"{deployment['threads_per_process']} | "
            + " | ".join(cells)
            + f" | {ttft} | {ratio:.2f}x |"
        )
    lines += [
        "",
        "## Tensor parallelism's all-reduces (TP=2, bf16, one decode step)",
        "",
        "Two all-reduces of the hidden state per layer; ring all-reduce time = "
        "2(N-1) x (latency + message / N / bandwidth).",
        "",
        "| model | link | batch | all-reduces / step | message | sent per rank per token "
        "| one all-reduce | comm per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["tp_comm"]:
        lines.append(
            f"| {row['model']} | {row['link']} | {row['batch']} | {row['allreduces_per_step']} "
            f"| {row['message_bytes'] / 1024:.1f} KiB "
            f"| {row['bytes_sent_per_rank_per_token'] / 1024:.0f} KiB "
            f"| {row['allreduce_us']:.1f} us | {row['step_comm_ms']:.2f} ms |"
        )
    nvlink_big = next(
        (r for r in report["tp_comm"]
         if r["model"] == MODELS[1].name and r["link"] == LINKS[0].name and r["batch"] == 8),
        None,
    )  # fmt: skip
    nvlink_cost = f"about {nvlink_big['step_comm_ms']:.1f} ms per step" if nvlink_big else "little"
    lines += [
        "",
        "Assumptions: " + "; ".join(f"{m['name']}: {m['note']}" for m in report["models"])
        + "; " + "; ".join(f"{link['name']}: {link['note']}" for link in report["links"]) + ".",
        "",
        "Across machines each all-reduce pays the network's per-message latency 2(N-1) "
        "times, twice per layer, whatever its bandwidth (the messages are tens of KiB). Over "
        f"NVLink the same all-reduces cost {nvlink_cost}. Data-parallel replicas exchange "
        "nothing per token, so they scale across machines; tensor parallelism belongs inside "
        "one.",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "scale", render_markdown, _plot)


def _plot(report: dict[str, Any]) -> Figure:
    fig, (left, right) = subplots(1, 2, figsize=(11, 4))
    concurrencies = report["settings"]["concurrencies"]
    width = 0.8 / len(report["measured"])
    for i, deployment in enumerate(report["measured"]):
        values = [(_level(deployment, c) or {}).get("output_tokens_per_s", 0.0)
                  for c in concurrencies]  # fmt: skip
        xs = [j + i * width for j in range(len(concurrencies))]
        left.bar(xs, values, width, label=deployment["deployment"])
    left.set_xticks([j + width for j in range(len(concurrencies))],
                    [f"c={c}" for c in concurrencies])  # fmt: skip
    left.set_ylabel("output tok/s")
    left.set_title("Measured on this machine")
    left.legend(fontsize=8)
    rows = [r for r in report["tp_comm"] if r["batch"] == 8]
    labels = [f"{r['model'].split(' ')[0]}\n{r['link'].split(' ')[0]}" for r in rows]
    right.bar(labels, [r["step_comm_ms"] for r in rows], color="#d95f02")
    right.set_yscale("log")
    right.set_ylabel("all-reduce time per decode step (ms)")
    right.set_title("TP=2 at batch 8: NVLink vs network")
    return fig
