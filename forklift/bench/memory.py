"""`forklift bench memory`: how much KV memory contiguous reservation wastes, and paging saves.

Part A replays the seed article's Figures 1 and 2 through forklift's own `KVCacheManager`.
Part B does the same arithmetic at scale with the real model's config and a mixed workload.
Part C measures reserved against used slots after every step of a real engine run.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from forklift.bench.kv_calc import dtype_bytes, kv_cache_bytes
from forklift.core.kv_cache_manager import KVCacheManager, blocks_for_tokens
from forklift.model.model_config import ModelConfig

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from forklift.engine.engine import LLMEngine

# Part A: the article's example, and the numbers its figures show.
SEED_REQUEST_TOKENS = (3, 5, 2)
SEED_MAX_LEN = 12
SEED_BLOCK_SIZE = 4
# Contiguous (reserved, used, unused, % wasted), paged (reserved, used, unused), slots freed.
SEED_EXPECTED = ((36, 10, 26, 72), (16, 10, 6), 20)

SCALE_BLOCK_SIZE = 16
# The default at-scale budget holds this many requests of max_model_len.
SCALE_CONTIGUOUS_REQUESTS = 16
SCALE_SEED = 0


@dataclass(frozen=True)
class SlotCount:
    """Reserved against used KV slots (tokens), and the unused share."""

    reserved: int
    used: int
    unused: int
    waste_fraction: float
    # Rounded to a whole percent, as the article reports it.
    waste_percent: int

    @classmethod
    def of(cls, reserved: int, used: int) -> SlotCount:
        unused = reserved - used
        fraction = unused / reserved if reserved else 0.0
        return cls(reserved, used, unused, fraction, round(100 * fraction))


@dataclass(frozen=True)
class FigureResult:
    """Part A: Figure 1 (contiguous reservation) against Figure 2 (paged)."""

    request_tokens: tuple[int, ...]
    max_len: int
    block_size: int
    contiguous: SlotCount
    paged: SlotCount
    freed_slots: int


@dataclass(frozen=True)
class ScaleSide:
    requests_in_flight: int
    slots: SlotCount


@dataclass(frozen=True)
class ScaleResult:
    """Part B: one KV budget, one workload, two allocators."""

    model: str
    dtype: str
    bytes_per_token: int
    budget_bytes: int
    budget_tokens: int
    max_model_len: int
    block_size: int
    workload: str
    mean_request_len: float
    contiguous: ScaleSide
    paged: ScaleSide
    # How many times more requests paging keeps in flight.
    gain: float


@dataclass(frozen=True)
class RunSpec:
    """Part C's workload: lengths drawn from these ranges with a fixed seed."""

    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    max_model_len: int = 512
    block_size: int = 16
    seed: int = 0


@dataclass
class WasteTally:
    """Reserved against used slots of every running request, summed over every step."""

    samples: int = 0
    waste_sum: int = 0
    waste_max: int = 0
    paged_reserved: int = 0
    used: int = 0
    contiguous_reserved: int = 0
    # Per step: (paged reserved, used, contiguous reserved), all running requests together.
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    peak_running: int = 0

    def add_step(self, pairs: Sequence[tuple[int, int]], max_model_len: int) -> None:
        for reserved, used in pairs:
            waste = reserved - used
            self.samples += 1
            self.waste_sum += waste
            self.waste_max = max(self.waste_max, waste)
        reserved = sum(r for r, _ in pairs)
        used = sum(u for _, u in pairs)
        contiguous = max_model_len * len(pairs)
        self.paged_reserved += reserved
        self.used += used
        self.contiguous_reserved += contiguous
        self.steps.append((reserved, used, contiguous))
        self.peak_running = max(self.peak_running, len(pairs))


@dataclass(frozen=True)
class MeasuredResult:
    """Part C: slot-steps (slots held, summed over the steps they were held) of a real run."""

    spec: RunSpec
    model: str
    dtype: str
    kv_cache_memory_bytes: int
    num_steps: int
    num_output_tokens: int
    requested_output_tokens: int
    num_preemptions: int
    wall_s: float
    mean_waste_tokens: float
    max_waste_tokens: int
    under_one_block: bool
    paged: SlotCount
    contiguous: SlotCount
    peak_paged_reserved: int
    peak_contiguous_reserved: int
    peak_used: int
    peak_running: int
    # Requests of max_model_len the same KV cache holds at once if each reserves it up front.
    contiguous_capacity: int
    # Per step: [paged reserved, used, contiguous reserved] over all running requests.
    steps: list[tuple[int, int, int]]


@dataclass(frozen=True)
class MemoryReport:
    command: str
    quick: bool
    figures: FigureResult
    at_scale: ScaleResult
    measured: MeasuredResult


# ---- Part A: the article's figures ------------------------------------------------------


def reserve_with_manager(reserve_tokens: Sequence[int], block_size: int) -> int:
    """Slots a `KVCacheManager` hands out when each request asks for `reserve_tokens[i]`."""
    needed = sum(blocks_for_tokens(n, block_size) for n in reserve_tokens)
    # One extra block: the pool keeps block 0 as the null block.
    manager = KVCacheManager(needed + 1, block_size)
    for index, tokens in enumerate(reserve_tokens):
        if not manager.allocate_slots(f"r{index}", tokens):
            raise RuntimeError(f"the cache ran out of blocks for request {index}")
    return sum(len(manager.block_table(f"r{i}")) for i in range(len(reserve_tokens))) * block_size


def seed_figures(
    request_tokens: Sequence[int] = SEED_REQUEST_TOKENS,
    max_len: int = SEED_MAX_LEN,
    block_size: int = SEED_BLOCK_SIZE,
) -> FigureResult:
    used = sum(request_tokens)
    # Contiguous reservation is paging with one block of max_len, reserved up front.
    contiguous = reserve_with_manager([max_len] * len(request_tokens), block_size=max_len)
    paged = reserve_with_manager(request_tokens, block_size=block_size)
    return FigureResult(
        request_tokens=tuple(request_tokens),
        max_len=max_len,
        block_size=block_size,
        contiguous=SlotCount.of(contiguous, used),
        paged=SlotCount.of(paged, used),
        freed_slots=contiguous - paged,
    )


def check_seed_figures(result: FigureResult) -> None:
    """The article's numbers must come out of forklift's allocator unchanged."""
    c, p = result.contiguous, result.paged
    got = (
        (c.reserved, c.used, c.unused, c.waste_percent),
        (p.reserved, p.used, p.unused),
        result.freed_slots,
    )
    if got != SEED_EXPECTED:
        raise RuntimeError(f"seed figures came out as {got}, expected {SEED_EXPECTED}")


# ---- Part B: the same comparison at scale -----------------------------------------------


def scale_lengths(max_model_len: int, seed: int) -> Iterator[int]:
    """An endless stream of prompt + output lengths, mostly far below max_model_len."""
    rng = random.Random(seed)
    while True:
        prompt = rng.randint(max(1, max_model_len // 128), max(1, max_model_len // 4))
        output = rng.randint(max(1, max_model_len // 256), max(1, max_model_len // 8))
        yield prompt + output


def admit_paged(lengths: Iterator[int], num_blocks: int, block_size: int) -> list[int]:
    """First-come first-served: admit requests until the next one's blocks do not fit."""
    admitted: list[int] = []
    free = num_blocks
    for length in lengths:
        need = blocks_for_tokens(length, block_size)
        if need > free:
            return admitted
        free -= need
        admitted.append(length)
    return admitted


def at_scale(
    config: ModelConfig,
    model_name: str,
    budget_bytes: int | None = None,
    block_size: int = SCALE_BLOCK_SIZE,
    seed: int = SCALE_SEED,
) -> ScaleResult:
    """Requests in flight under one KV budget: reserve max_model_len each, or pay per block.

    Each request counts at its final length (prompt + all output), paging's fullest moment.
    """
    # The dtype a GPU serves in; it scales bytes, not the comparison.
    dtype = "bfloat16"
    max_len = config.max_position_embeddings
    per_token = kv_cache_bytes(
        config.num_layers, config.num_kv_heads, config.head_dim, 1, dtype_bytes(dtype)
    )
    if budget_bytes is None:
        budget_bytes = per_token * max_len * SCALE_CONTIGUOUS_REQUESTS
    budget_tokens = budget_bytes // per_token
    if budget_tokens < max_len:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {budget_tokens} tokens, less than one "
            f"request of max_model_len={max_len}"
        )
    paged = admit_paged(scale_lengths(max_len, seed), budget_tokens // block_size, block_size)
    num_contiguous = budget_tokens // max_len
    contiguous = _take(scale_lengths(max_len, seed), num_contiguous)
    paged_reserved = sum(blocks_for_tokens(n, block_size) for n in paged) * block_size
    return ScaleResult(
        model=model_name,
        dtype=dtype,
        bytes_per_token=per_token,
        budget_bytes=budget_bytes,
        budget_tokens=budget_tokens,
        max_model_len=max_len,
        block_size=block_size,
        workload=(
            f"seeded RNG ({seed}): prompt in [{max_len // 128}, {max_len // 4}] + output in "
            f"[{max_len // 256}, {max_len // 8}] tokens"
        ),
        mean_request_len=sum(paged) / len(paged),
        contiguous=ScaleSide(
            num_contiguous, SlotCount.of(num_contiguous * max_len, sum(contiguous))
        ),
        paged=ScaleSide(len(paged), SlotCount.of(paged_reserved, sum(paged))),
        gain=len(paged) / num_contiguous,
    )


def _take(lengths: Iterator[int], count: int) -> list[int]:
    return [next(lengths) for _ in range(count)]


# ---- Part C: measured on a real engine --------------------------------------------------


def run_spec(quick: bool) -> RunSpec:
    if quick:
        return RunSpec(num_requests=8, prompt_len=(8, 96), output_len=(8, 32))
    return RunSpec(num_requests=32, prompt_len=(16, 320), output_len=(16, 160))


def make_workload(spec: RunSpec, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, the same on every run."""
    rng = random.Random(spec.seed)
    workload = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_len)
        output_len = rng.randint(*spec.output_len)
        # Skip the lowest ids, where special tokens live.
        prompt = [rng.randrange(100, vocab_size) for _ in range(prompt_len)]
        workload.append((prompt, output_len))
    return workload


def kv_bytes_for(
    workload: Sequence[tuple[list[int], int]], spec: RunSpec, bytes_per_token: int
) -> int:
    """Room for the whole workload at once, plus the null block; never below what the engine
    needs to start (one request of max_model_len)."""
    blocks = sum(blocks_for_tokens(len(p) + n, spec.block_size) for p, n in workload)
    blocks = max(blocks, blocks_for_tokens(spec.max_model_len, spec.block_size)) + 1
    return blocks * spec.block_size * bytes_per_token


def running_slots(engine: LLMEngine) -> list[tuple[int, int]]:
    """(reserved slots, used slots) of every running request, right after a step."""
    kv = engine.kv_cache
    return [
        (len(kv.block_table(r.request_id)) * kv.block_size, r.num_computed_tokens)
        for r in engine.scheduler.running
    ]


@dataclass(frozen=True)
class RunTotals:
    output_tokens: int
    # What the workload asked for; with EOS ignored every request must deliver all of it.
    requested_output_tokens: int
    wall_s: float


def measure_run(
    spec: RunSpec, model: str | None, model_name: str, config: ModelConfig
) -> MeasuredResult:
    # Imported here: Parts A and B need no model weights.
    import torch

    from forklift.runner.memory import kv_bytes_per_token

    workload = make_workload(spec, config.vocab_size)
    kv_bytes = kv_bytes_for(workload, spec, kv_bytes_per_token(config, torch.float32))
    engine = start_engine(spec, model, kv_bytes)
    add_workload(engine, workload)
    tally = WasteTally()
    started = time.perf_counter()
    output_tokens = drive(engine, tally, spec.max_model_len)
    totals = RunTotals(
        output_tokens, sum(n for _, n in workload), round(time.perf_counter() - started, 2)
    )
    return _measured_result(spec, engine, model_name, tally, kv_bytes, totals)


def start_engine(spec: RunSpec, model: str | None, kv_bytes: int) -> LLMEngine:
    from forklift.engine.engine import LLMEngine

    return LLMEngine.from_kwargs(
        model=model,
        dtype="float32",
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        kv_cache_memory_bytes=kv_bytes,
    )


def add_workload(engine: LLMEngine, workload: Sequence[tuple[list[int], int]]) -> None:
    from forklift.sampling_params import SamplingParams

    for index, (prompt, output_len) in enumerate(workload):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"req-{index}", prompt, params)


def drive(engine: LLMEngine, tally: WasteTally, max_model_len: int) -> int:
    """Step until every request finishes, tallying slots after each step; output tokens."""
    output_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                output_tokens += len(output.outputs[0].token_ids)
        tally.add_step(running_slots(engine), max_model_len)
    return output_tokens


def _measured_result(
    spec: RunSpec,
    engine: LLMEngine,
    model_name: str,
    tally: WasteTally,
    kv_bytes: int,
    totals: RunTotals,
) -> MeasuredResult:
    mean_waste = tally.waste_sum / tally.samples if tally.samples else 0.0
    return MeasuredResult(
        spec=spec,
        model=model_name,
        dtype="float32",
        kv_cache_memory_bytes=kv_bytes,
        num_steps=len(tally.steps),
        num_output_tokens=totals.output_tokens,
        requested_output_tokens=totals.requested_output_tokens,
        num_preemptions=engine.scheduler.num_preemptions,
        wall_s=totals.wall_s,
        mean_waste_tokens=round(mean_waste, 3),
        max_waste_tokens=tally.waste_max,
        under_one_block=tally.waste_max < spec.block_size,
        paged=SlotCount.of(tally.paged_reserved, tally.used),
        contiguous=SlotCount.of(tally.contiguous_reserved, tally.used),
        peak_paged_reserved=max((s[0] for s in tally.steps), default=0),
        peak_contiguous_reserved=max((s[2] for s in tally.steps), default=0),
        peak_used=max((s[1] for s in tally.steps), default=0),
        peak_running=tally.peak_running,
        contiguous_capacity=engine.kv_plan.token_capacity // spec.max_model_len,
        steps=tally.steps,
    )


# ---- the whole benchmark ----------------------------------------------------------------


def run_memory_bench(
    out_dir: Path, command: str, quick: bool, model: str | None, budget_gib: float | None
) -> MemoryReport:
    from forklift.model.model_source import load_model_config, resolve_model

    figures = seed_figures()
    check_seed_figures(figures)
    source = resolve_model(model)
    config = load_model_config(source)
    budget = int(budget_gib * 2**30) if budget_gib is not None else None
    scale = at_scale(config, source.path.name, budget)
    measured = measure_run(run_spec(quick), model, source.path.name, config)
    report = MemoryReport(command, quick, figures, scale, measured)
    write_report(report, out_dir)
    return report


def write_report(report: MemoryReport, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "memory.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    (out_dir / "memory.md").write_text(markdown(report))
    plot(report, out_dir / "memory.png")


def summary(report: MemoryReport) -> str:
    """The headline numbers, for the terminal."""
    f, s, m = report.figures, report.at_scale, report.measured
    return "\n".join(
        [
            f"seed figures: contiguous {f.contiguous.reserved} reserved / {f.contiguous.used} "
            f"used ({f.contiguous.waste_percent}% wasted); paged {f.paged.reserved} / "
            f"{f.paged.used}; {f.freed_slots} slots freed",
            f"at scale: {s.contiguous.requests_in_flight} requests in flight contiguous vs "
            f"{s.paged.requests_in_flight} paged ({s.gain:.1f}x)",
            f"measured: waste per request mean {m.mean_waste_tokens:.2f}, max "
            f"{m.max_waste_tokens} tokens (block size {m.spec.block_size}); overall "
            f"{100 * m.paged.waste_fraction:.1f}% paged vs "
            f"{100 * m.contiguous.waste_fraction:.1f}% contiguous",
        ]
    )


# ---- markdown ---------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _slot_row(name: str, slots: SlotCount, *extra: object) -> list[object]:
    cells = [f"{slots.reserved:,}", f"{slots.used:,}", f"{slots.unused:,}"]
    return [name, *cells, f"{100 * slots.waste_fraction:.1f}%", *extra]


def _figures_md(f: FigureResult) -> list[str]:
    header = ["allocator", "reserved", "used", "unused", "wasted"]
    rows = [
        _slot_row(f"contiguous (max {f.max_len} each)", f.contiguous),
        _slot_row(f"paged (blocks of {f.block_size})", f.paged),
    ]
    return [
        "## A. The seed figures",
        "",
        f"Requests holding {', '.join(map(str, f.request_tokens))} tokens, max length "
        f"{f.max_len}, blocks of {f.block_size}; slots counted from forklift's `KVCacheManager`.",
        "",
        *_table(header, rows),
        "",
        f"Contiguous reservation wastes {f.contiguous.unused} of {f.contiguous.reserved} slots "
        f"({f.contiguous.waste_percent}%). Paging reserves {f.paged.reserved} and frees "
        f"{f.freed_slots} slots for other requests.",
        "",
    ]


def _scale_md(s: ScaleResult) -> list[str]:
    header = ["allocator", "reserved tokens", "used tokens", "unused", "wasted", "in flight"]
    rows = [
        _slot_row(
            f"contiguous ({s.max_model_len} each)",
            s.contiguous.slots,
            s.contiguous.requests_in_flight,
        ),
        _slot_row(f"paged (blocks of {s.block_size})", s.paged.slots, s.paged.requests_in_flight),
    ]
    return [
        "## B. At scale",
        "",
        f"{s.model}: {s.bytes_per_token:,} KV bytes per token in {s.dtype}; budget "
        f"{s.budget_bytes / 2**30:.2f} GiB = {s.budget_tokens:,} tokens; max_model_len "
        f"{s.max_model_len}. Workload: {s.workload} (mean {s.mean_request_len:.0f} tokens); "
        "each request counted at its final length.",
        "",
        *_table(header, rows),
        "",
        f"Paging keeps {s.gain:.1f}x as many requests in flight.",
        "",
    ]


def _measured_md(m: MeasuredResult) -> list[str]:
    header = ["allocator", "reserved slot-steps", "used", "unused", "wasted", "peak reserved"]
    rows = [
        _slot_row(
            f"contiguous ({m.spec.max_model_len} each)",
            m.contiguous,
            f"{m.peak_contiguous_reserved:,}",
        ),
        _slot_row(f"paged (blocks of {m.spec.block_size})", m.paged, f"{m.peak_paged_reserved:,}"),
    ]
    return [
        "## C. Measured on a real run",
        "",
        f"{m.model} in {m.dtype}: {m.spec.num_requests} requests, prompts of "
        f"{m.spec.prompt_len[0]}-{m.spec.prompt_len[1]} tokens, outputs of "
        f"{m.spec.output_len[0]}-{m.spec.output_len[1]} (greedy, EOS ignored), max_model_len "
        f"{m.spec.max_model_len}. {m.num_steps} steps, {m.num_output_tokens} output tokens, "
        f"{m.num_preemptions} preemptions, {m.wall_s:.1f} s. After every step, each running "
        "request's reserved slots (block table x block size) against its computed tokens; the "
        "contiguous row is what reserving max_model_len per request would have held in the "
        "same steps.",
        "",
        *_table(header, rows),
        "",
        f"Waste per request: mean {m.mean_waste_tokens:.2f} tokens, max {m.max_waste_tokens} "
        f"(block size {m.spec.block_size}: under one block = {m.under_one_block}). Peak used "
        f"{m.peak_used:,} slots. The run's KV cache ({m.kv_cache_memory_bytes / 2**20:.1f} MiB) "
        f"held up to {m.peak_running} requests at once; reserving max_model_len each, it would "
        f"hold {m.contiguous_capacity}.",
        "",
    ]


def markdown(report: MemoryReport) -> str:
    lines = [
        "# KV-cache memory: contiguous reservation vs paged blocks",
        "",
        f"Produced by `{report.command}`" + (" (quick mode)." if report.quick else "."),
        "",
        *_figures_md(report.figures),
        *_scale_md(report.at_scale),
        *_measured_md(report.measured),
    ]
    return "\n".join(lines)


# ---- chart ------------------------------------------------------------------------------


def plot(report: MemoryReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, s, m = report.figures, report.at_scale, report.measured
    panels = [
        ("A. Seed Figure 1 vs Figure 2: slots", f.contiguous, f.paged, None),
        (
            f"B. At scale ({s.budget_tokens:,}-token budget): tokens",
            s.contiguous.slots,
            s.paged.slots,
            (s.contiguous.requests_in_flight, s.paged.requests_in_flight),
        ),
        (f"C. Measured run ({m.num_steps} steps): slot-steps", m.contiguous, m.paged, None),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, (title, contiguous, paged, in_flight) in zip(axes, panels, strict=True):
        _bar_panel(ax, title, contiguous, paged, in_flight)
    fig.suptitle("KV cache: reserved vs used, contiguous reservation vs paged blocks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bar_panel(
    ax: Axes,
    title: str,
    contiguous: SlotCount,
    paged: SlotCount,
    in_flight: tuple[int, int] | None,
) -> None:
    from matplotlib.ticker import StrMethodFormatter

    labels = [
        f"{name}\n{100 * slots.waste_fraction:.1f}% wasted"
        for name, slots in (("contiguous", contiguous), ("paged", paged))
    ]
    if in_flight is not None:
        labels = [f"{label}\n{n} in flight" for label, n in zip(labels, in_flight, strict=True)]
    xs = [0.0, 1.0]
    width = 0.38
    reserved = [contiguous.reserved, paged.reserved]
    used = [contiguous.used, paged.used]
    bars_r = ax.bar([x - width / 2 for x in xs], reserved, width, label="reserved", color="#d9822b")
    bars_u = ax.bar([x + width / 2 for x in xs], used, width, label="used", color="#2b7bd9")
    ax.bar_label(bars_r, labels=[f"{v:,}" for v in reserved], fontsize=8)
    ax.bar_label(bars_u, labels=[f"{v:,}" for v in used], fontsize=8)
    ax.set_xticks(xs, labels)
    # Plain thousands, not an offset like "1e6" that hides the scale in a corner.
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_title(title, fontsize=10)
    # Headroom above the tallest bar keeps the legend clear of the value labels.
    ax.set_ylim(0, max(reserved) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncols=2)
