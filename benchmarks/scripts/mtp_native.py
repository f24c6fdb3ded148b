"""Qwen3.5's MTP layer drafting as a native step against the PyTorch layer it replaces, on
a Qwen3.5-0.8B-shaped bf16 checkpoint with random weights (make_hybrid_gguf.py's shapes,
an MTP layer made from its first full-attention layer and a random `fc`), the target on
the native step's dense tiles (AMX). One process, sides alternating over `--rounds`: each
round decodes `--tokens` tokens after a `--prompt`-token prompt with three guesses a step
(fixed, so random weights' rejected guesses do not switch drafting off), and times every
call of the drafter.

    .venv/bin/python benchmarks/scripts/mtp_native.py
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from make_hybrid_gguf import SHAPES
from results import command_line, write_results
from revision_build import ROOT
from safetensors.torch import load_file, save_file

from forklift import LLM, SamplingParams
from forklift.bench.report import cpu_flags

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
SIDES = ("native step", "PyTorch layer")


def make_checkpoint(directory: Path) -> None:
    """The default model's tokenizer, random bf16 weights, and an MTP layer."""
    forklift = Path(sys.executable).with_name("forklift")
    subprocess.run([str(forklift), "tokenizer", "export", str(directory)], check=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    config = transformers.Qwen3_5TextConfig(
        **SHAPES, bos_token_id=tokenizer.bos_token_id or 0, eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.02, torch_dtype="bfloat16",
    )  # fmt: skip
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    path = next(directory.glob("*.safetensors"))
    tensors = load_file(path)
    full = config.layer_types.index("full_attention")
    prefix = f"model.layers.{full}."
    hidden = config.hidden_size
    mtp = {"mtp." + name.replace(prefix, "layers.0."): t.clone()
           for name, t in tensors.items() if name.startswith(prefix)}  # fmt: skip
    fc = torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5
    mtp["mtp.fc.weight"] = fc.to(torch.bfloat16)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})


def one_round(directory: Path, side: str, args: argparse.Namespace, seed: int) -> dict:
    llm = LLM(model=str(directory), dtype="bfloat16", max_model_len=2048,
              kv_cache_memory_bytes=512 * 2**20, speculative_config=MTP)  # fmt: skip
    runner, proposer = llm.llm_engine.runner, llm.llm_engine.proposer
    if not runner.backend.dense_step:
        raise SystemExit("this benchmark needs the native step on dense bf16 tiles (AMX)")
    if side == "PyTorch layer":
        proposer._native_binding = lambda: None
    calls: list[float] = []
    propose = proposer.propose_batch

    def timed(queries):
        start = time.perf_counter()
        drafts = propose(queries)
        calls.append(time.perf_counter() - start)
        return drafts

    proposer.propose_batch = timed
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    warm = [rng.randrange(1000, vocab) for _ in range(64)]
    llm.generate([{"prompt_token_ids": warm}], params.clone(max_tokens=8), use_tqdm=False)
    calls.clear()
    prompt = [rng.randrange(1000, vocab) for _ in range(args.prompt)]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    first_call = calls[0]  # the catch-up over the whole prompt
    result = {
        "seconds": seconds,
        "catch_up_ms": first_call * 1000,
        "guess_call_ms": statistics.median(calls[1:]) * 1000,
        "calls": len(calls),
        "drafting_share": sum(calls) / seconds,
    }
    del llm, proposer, runner
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=564)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "sapphire-rapids")
    args = parser.parse_args()
    rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as work:
        directory = Path(work) / "qwen35-0.8b-mtp"
        make_checkpoint(directory)
        for index in range(args.rounds):
            for side in SIDES if index % 2 == 0 else reversed(SIDES):
                rounds[side].append(one_round(directory, side, args, seed=index))
                print(side, rounds[side][-1], flush=True)
    summary = {
        side: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for side, results in rounds.items()
    }
    report = {"workload": vars(args) | {"out_dir": None}, "rounds": rounds, "summary": summary,
              "cpu_flags": sorted(cpu_flags())}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_results(args.out_dir, "mtp-native", report, table(report), command_line(__file__))


def table(report: dict) -> list[str]:
    w, s = report["workload"], report["summary"]
    native, torch_side = s["native step"], s["PyTorch layer"]
    lines = [
        "# Qwen3.5's MTP layer: native step vs PyTorch layer",
        "",
        f"A Qwen3.5-0.8B-shaped bf16 checkpoint (random weights, an MTP layer), the target on "
        f"the native step's dense tiles; one sequence, a {w['prompt']}-token prompt then "
        f"{w['tokens']} tokens with three guesses a step; medians of {w['rounds']} rounds, "
        "sides alternating in one process.",
        "",
        "| drafter | first call: the prompt's catch-up (past the dense step's 64 rows, so "
        "the PyTorch layer on both sides) | a call after a step (catch-up, 3 guesses) | "
        "share of the generation spent drafting | generation |",
        "|---|---|---|---|---|",
    ]
    for side in SIDES:
        r = s[side]
        lines.append(f"| {side} | {r['catch_up_ms']:.1f} ms | {r['guess_call_ms']:.1f} ms | "
                     f"{100 * r['drafting_share']:.1f}% | {r['seconds']:.2f} s |")  # fmt: skip
    lines += [
        "",
        f"A drafting call: {torch_side['guess_call_ms'] / native['guess_call_ms']:.2f}x faster "
        f"native; the whole generation {torch_side['seconds'] / native['seconds']:.2f}x.",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
