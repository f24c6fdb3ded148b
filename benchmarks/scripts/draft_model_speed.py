"""Does a draft model pay on the default model? Its only same-tokenizer draft is itself, so
the self-speculative form (the target's first L layers, its norm and head) is measured:
single stream, greedy, the input-grounded prompts of `bench spec`, against no speculation
and n-gram lookup, each engine in this one process, one after the other. Writes
benchmarks/<dir>/draft-model.{md,json}.

Run: .venv/bin/python benchmarks/scripts/draft_model_speed.py [out_dir]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags
from forklift.bench.spec_workload import WORKLOADS

PROMPTS = 4
MAX_TOKENS = 128
CONFIGS = {
    "none": None,
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8},
    "draft_layers=8, k=3": {"method": "draft_model", "draft_layers": 8,
                            "num_speculative_tokens": 3, "adaptive_draft_length": False},
    "draft_layers=20, k=3": {"method": "draft_model", "draft_layers": 20,
                             "num_speculative_tokens": 3, "adaptive_draft_length": False},
    "draft_layers=30 (itself), k=3": {"method": "draft_model", "draft_layers": 30,
                                      "num_speculative_tokens": 3,
                                      "adaptive_draft_length": False},
    "draft_layers=20, k=3, adaptive": {"method": "draft_model", "draft_layers": 20,
                                       "num_speculative_tokens": 3},
    "none, again (drift)": None,
}  # fmt: skip


def measure(spec: dict | None) -> dict:
    llm = LLM(speculative_config=spec, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [[{"role": "user", "content": t}] for t in WORKLOADS["input-grounded"][:PROMPTS]]
    llm.chat(prompts[:1], params.clone(max_tokens=8), use_tqdm=False)  # warm up
    stats = llm.llm_engine.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    tokens, seconds, texts = 0, 0.0, []
    for prompt in prompts:
        started = time.perf_counter()
        output = llm.chat([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - started
        tokens += len(output.token_ids)
        texts.append(output.token_ids)
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None, "outputs": texts}  # fmt: skip


def main() -> None:
    here = Path(__file__).resolve().parents[1]
    out_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else here
    rows = {name: measure(spec) for name, spec in CONFIGS.items()}
    base = rows["none"]
    expected = base["outputs"]
    for row in rows.values():
        row["speedup"] = row["tok_s"] / base["tok_s"]
        row["same_tokens"] = row["outputs"] == expected
    for row in rows.values():
        del row["outputs"]
    report = {"cpu_flags": cpu_flags(), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
              "rows": rows}  # fmt: skip
    (out_dir / "draft-model.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Draft-model speculation on the default model (self-speculative form)",
        "",
        f"Single stream, greedy, {PROMPTS} input-grounded prompts of `bench spec`, "
        f"{MAX_TOKENS} tokens each, one engine after another in one process.",
        "",
        "| configuration | output tok/s | vs none | drafts accepted | same tokens as none |",
        "|---|---:|---:|---:|---|",
    ]
    for name, row in rows.items():
        rate = (
            "-"
            if row["acceptance"] is None
            else (f"{row['accepted_tokens']}/{row['draft_tokens']} ({row['acceptance']:.2f})")
        )
        lines.append(f"| {name} | {row['tok_s']:.1f} | {row['speedup']:.2f}x | {rate} | "
                     f"{'yes' if row['same_tokens'] else 'no'} |")  # fmt: skip
    lines += [
        "",
        "Command: `.venv/bin/python benchmarks/scripts/draft_model_speed.py "
        f"{out_dir.relative_to(Path(__file__).resolve().parents[2])}`",
        f"CPU flags: {' '.join(report['cpu_flags'])}",
    ]
    (out_dir / "draft-model.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
