"""A dense bf16 model on AMX tiles, one forward against the split paths, side by side: every
step on the native step's tiles (`batch_invariant`, the default) against prefill chunks on
the PyTorch layers (oneDNN's GEMM) beside native decode steps (`batch_invariant=False`).

The model is a bf16 Hugging Face directory, e.g. the one `vllm_cpu_setup.sh` (the project's
peer scripts) makes from the default model's GGUF file, so these are the weights vLLM's CPU
build serves. Both engines live in one process (1 GiB of KV cache each) and alternate round
by round: one 730-token prompt (the serving sweep's first token at c=1), four 512-token
prompts (llama-bench's pp512 shape), and 8 sequences decoding 64 tokens each after
564-token prompts. Each engine's temperature-0 answer to one prompt is also compared
alone and beside seven others.

    .venv/bin/python benchmarks/scripts/dense_one_forward.py MODEL_DIR [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from results import command_line, write_results
from revision_build import ROOT

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags

FORMS = {"one forward": True, "split (PyTorch prefill)": False}


def _prompts(rng: np.random.Generator, count: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, length)]}
            for _ in range(count)]  # fmt: skip


def _seconds(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def _measure(llm: LLM, rng: np.random.Generator) -> dict[str, float]:
    one = SamplingParams(max_tokens=1, temperature=0)
    decode = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
    first = _seconds(llm, _prompts(rng, 1, 730), one)
    pp512 = _seconds(llm, _prompts(rng, 4, 512), one)
    prompts = _prompts(rng, 8, 564)
    prefill = _seconds(llm, prompts, one)
    both = _seconds(llm, prompts, decode)  # the same prompts again: prefill plus 64 steps
    return {
        "first_token_730_ms": first * 1e3,
        "prefill_4x512_tok_s": 4 * 512 / pp512,
        "decode_batch8_tok_s": 8 * 64 / max(both - prefill, 1e-9),
    }


def _tokens_alone_and_beside(llm: LLM) -> bool:
    rng = np.random.default_rng(7)
    prompt = _prompts(rng, 1, 300)
    others = _prompts(rng, 7, 200)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)

    def run(requests):
        out = llm.generate(requests, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in s.items()} for s in out.logprobs]

    return run(prompt) == run(prompt + others)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    args = parser.parse_args()
    engines = {
        name: LLM(
            model=str(args.model),
            max_model_len=2048,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=2**30,
            batch_invariant=invariant,
        )  # fmt: skip
        for name, invariant in FORMS.items()
    }
    rng = np.random.default_rng(0)
    for llm in engines.values():  # warm-up
        _measure(llm, rng)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            rounds[name].append(_measure(llm, rng))
    metrics = list(rounds["one forward"][0])
    medians = {n: {m: statistics.median(r[m] for r in rs) for m in metrics}
               for n, rs in rounds.items()}  # fmt: skip
    ratios = {}
    for m in metrics:
        per_round = [
            (a[m] / b[m]) if not m.endswith("_ms") else (b[m] / a[m])
            for a, b in zip(rounds["one forward"], rounds["split (PyTorch prefill)"], strict=True)
        ]
        ratios[m] = {"median": statistics.median(per_round), "min": min(per_round),
                     "max": max(per_round)}  # fmt: skip
    invariant = {name: _tokens_alone_and_beside(llm) for name, llm in engines.items()}
    weights = {name: llm.llm_engine.runner.weight_bytes for name, llm in engines.items()}
    labels = {
        "first_token_730_ms": "one 730-token prompt, ms to its first token",
        "prefill_4x512_tok_s": "prefill, 4 x 512 tokens, tok/s",
        "decode_batch8_tok_s": "decode, 8 sequences after 564 tokens, tok/s",
    }
    lines = [
        "# Dense bf16 on AMX tiles: one forward against PyTorch prefill",
        "",
        f"Model: a bf16 Hugging Face directory ({args.model.name}), {args.rounds} alternating "
        "rounds in one process, medians; ratio: one forward's speed over the split paths' "
        "(above 1: one forward is faster), median (min-max) of the rounds.",
        "",
        "| what | one forward | split (PyTorch prefill) | ratio |",
        "|---|---|---|---|",
    ]
    for m in metrics:
        r = ratios[m]
        lines.append(
            f"| {labels[m]} | {medians['one forward'][m]:.1f} | "
            f"{medians['split (PyTorch prefill)'][m]:.1f} | "
            f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) |"
        )
    lines += [
        "",
        "Same temperature-0 tokens and logprobs for a prompt alone and beside seven others: "
        + ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok in invariant.items())
        + ".",
        "Weights the memory plan counts: "
        + ", ".join(f"{n}: {b / 2**20:.1f} MiB" for n, b in weights.items())
        + ".",
        "",
    ]
    report = {"model": args.model.name, "rounds": rounds, "medians": medians, "ratios": ratios,
              "same_tokens_beside_others": invariant, "weight_bytes": weights,
              "cpu_flags": cpu_flags()}  # fmt: skip
    command = command_line(__file__, "MODEL_DIR", "--rounds", args.rounds)
    write_results(args.out_dir, "dense-one-forward", report, lines, command)


if __name__ == "__main__":
    main()
