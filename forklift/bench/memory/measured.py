"""Part C: reserved against used slots after every step of a real engine run."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forklift.bench.memory.slots import SlotCount, slot_row
from forklift.bench.report import markdown_table
from forklift.core.kv_cache_manager import blocks_for_tokens
from forklift.engine.engine import LLMEngine
from forklift.model.kv_cache_dtype import kv_cache_format
from forklift.model.model_config import ModelConfig
from forklift.runner.memory import kv_bytes_per_token
from forklift.sampling_params import SamplingParams

# The measured run's dtype: exact on any CPU (`measure_run` sizes the KV cache in it).
DTYPE = "float32"


@dataclass(frozen=True)
class RunSpec:
    """The workload: lengths drawn from these ranges with a fixed seed."""

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
    """Slot-steps (slots held, summed over the steps they were held) of a real run."""

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
class RunTotals:
    output_tokens: int
    # What the workload asked for; with EOS ignored every request must deliver all of it.
    requested_output_tokens: int
    wall_s: float


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


def measure_run(
    spec: RunSpec, model: str | None, model_name: str, config: ModelConfig
) -> MeasuredResult:
    workload = make_workload(spec, config.vocab_size)
    kv_bytes = kv_bytes_for(
        workload, spec, kv_bytes_per_token(config, kv_cache_format("auto", torch.float32))
    )
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
    return LLMEngine.from_kwargs(
        model=model,
        dtype=DTYPE,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        kv_cache_memory_bytes=kv_bytes,
    )


def add_workload(engine: LLMEngine, workload: Sequence[tuple[list[int], int]]) -> None:
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
        tally.add_step(engine.stats(with_running_slots=True).running_slots, max_model_len)
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
        dtype=DTYPE,
        kv_cache_memory_bytes=kv_bytes,
        num_steps=len(tally.steps),
        num_output_tokens=totals.output_tokens,
        requested_output_tokens=totals.requested_output_tokens,
        num_preemptions=engine.stats().num_preemptions,
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


def measured_markdown(m: MeasuredResult) -> list[str]:
    header = ["allocator", "reserved slot-steps", "used", "unused", "wasted", "peak reserved"]
    rows = [
        slot_row(
            f"contiguous ({m.spec.max_model_len} each)",
            m.contiguous,
            f"{m.peak_contiguous_reserved:,}",
        ),
        slot_row(f"paged (blocks of {m.spec.block_size})", m.paged, f"{m.peak_paged_reserved:,}"),
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
        *markdown_table(header, rows),
        "",
        f"Waste per request: mean {m.mean_waste_tokens:.2f} tokens, max {m.max_waste_tokens} "
        f"(block size {m.spec.block_size}: under one block = {m.under_one_block}). Peak used "
        f"{m.peak_used:,} slots. The run's KV cache ({m.kv_cache_memory_bytes / 2**20:.1f} MiB) "
        f"held up to {m.peak_running} requests at once; reserving max_model_len each, it would "
        f"hold {m.contiguous_capacity}.",
        "",
    ]
