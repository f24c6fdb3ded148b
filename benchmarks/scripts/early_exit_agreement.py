"""Would self-speculation pay on the default model? The draft of the self-speculative form is
the target's own first L layers, its final norm and its head. Along the full model's greedy
continuations of both `bench spec` workloads, count how often that draft's greedy token is the
full model's. Writes benchmarks/self-speculation.{md,json}.

Run: .venv/bin/python benchmarks/scripts/early_exit_agreement.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from forklift.bench.report import cpu_flags
from forklift.bench.spec_workload import WORKLOADS
from forklift.checkpoint.source import resolve_model
from forklift.hf_reference import load_hf_model
from forklift.model.model_source import load_model_config
from forklift.tokenizer import load_tokenizer

EXIT_LAYERS = (4, 8, 12, 16, 20, 24, 28)
PROMPTS_PER_WORKLOAD = 6
NEW_TOKENS = 64


def main() -> None:
    source = resolve_model(None)
    config = load_model_config(source)
    model = load_hf_model(source, config, torch.float32).eval()
    tokenizer = load_tokenizer(source)
    agree = dict.fromkeys(EXIT_LAYERS, 0)
    total = 0
    for prompts in WORKLOADS.values():
        for text in prompts[:PROMPTS_PER_WORKLOAD]:
            ids = torch.tensor([tokenizer.encode_chat([{"role": "user", "content": text}])])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                hidden = model(out, output_hidden_states=True).hidden_states
                start = ids.shape[1] - 1
                full = model.lm_head(model.model.norm(hidden[-1]))[0, start:-1].argmax(-1)
                for layer in EXIT_LAYERS:
                    logits = model.lm_head(model.model.norm(hidden[layer]))[0, start:-1]
                    agree[layer] += int((logits.argmax(-1) == full).sum())
            total += full.numel()
    rows = [
        {
            "exit_layer": layer,
            "draft_cost": layer / config.num_layers,
            "agreement": agree[layer] / total,
        }
        for layer in EXIT_LAYERS
    ]
    out_dir = Path(__file__).resolve().parents[1]
    report = {"model": source.path.name, "layers": config.num_layers, "tokens": total,
              "cpu_flags": cpu_flags(), "rows": rows}  # fmt: skip
    (out_dir / "self-speculation.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Self-speculation on the default model: does an early exit guess the next token?",
        "",
        f"Model `{source.path.name}` ({config.num_layers} layers), fp32, greedy. Along the full "
        f"model's own continuations ({NEW_TOKENS} tokens of {PROMPTS_PER_WORKLOAD} prompts of "
        f"each `bench spec` workload, {total} tokens), the share of positions where the first "
        "L layers + final norm + head pick the full model's token. A draft token costs about "
        "L / layers of a step, so drafting pays only when agreement is well above that cost.",
        "",
        "| exit layer L | draft cost (share of a step) | agreement with the full model |",
        "|---|---|---|",
        *(f"| {r['exit_layer']} | {r['draft_cost']:.2f} | {r['agreement']:.3f} |" for r in rows),
        "",
        "Command: `.venv/bin/python benchmarks/scripts/early_exit_agreement.py`",
        f"CPU flags: {' '.join(report['cpu_flags'])}",
    ]
    (out_dir / "self-speculation.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
