"""`forklift bench hybrid`: a Qwen3.5 hybrid against its all-attention twin, one run.

Both models are random (built with transformers; nothing is downloaded) and have the default
model's size: the same hidden size, MLP, layer count, heads and vocabulary. The twin is a
Llama, every layer full attention; the hybrid makes three of every four layers Gated DeltaNet
(a fixed-size state per sequence instead of a growing KV cache). For each dtype, context and
batch size the report gives the prefill rate of one prompt and the decode step time, so the
ratio says what the linear layers cost or save on this CPU as the context grows.
"""

from __future__ import annotations

import gc
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from forklift.bench.decode import prefill_steps, time_pure_decode
from forklift.bench.report import cpu_flags, write_report_files
from forklift.llm import LLM
from forklift.runner.memory import kv_bytes_per_token, state_bytes_per_sequence
from forklift.sampling_params import SamplingParams

# SmolLM2-135M's shape; the hybrid's linear layers get 4 key and 8 value heads of 64.
DEFAULT_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
)  # fmt: skip
LINEAR_SHAPE = dict(
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
)  # fmt: skip
TINY_SHAPE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
)  # fmt: skip
TINY_LINEAR_SHAPE = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=4,
)  # fmt: skip


# Extra output tokens per request beyond bench decode's: the warm-up passes ask for one step.
_MARGIN = 8


@dataclass
class HybridSettings:
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    contexts: tuple[int, ...] = (564, 2048)
    batch_sizes: tuple[int, ...] = (1, 8)
    timed_steps: int = 8
    tiny: bool = False  # a toy shape, for the test suite

    @classmethod
    def quick(cls, **overrides: Any) -> HybridSettings:
        return cls(**{"dtypes": ("float32",), "contexts": (64,), "batch_sizes": (1, 2),
                      "timed_steps": 2, "tiny": True, **overrides})  # fmt: skip


@dataclass
class HybridPoint:
    model: str  # "hybrid" or "attention"
    dtype: str
    context: int
    batch_size: int
    prefill_tokens_per_s: float
    decode_step_ms: float
    decode_tokens_per_s: float
    cache_bytes_per_sequence: int  # KV at this context plus any linear-layer state


def build_models(directory: Path, tiny: bool) -> dict[str, Path]:
    """The hybrid and its twin, saved as HF safetensors directories."""
    import transformers

    shape = TINY_SHAPE if tiny else DEFAULT_SHAPE
    linear = TINY_LINEAR_SHAPE if tiny else LINEAR_SHAPE
    common = dict(shape, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    models = {
        "hybrid": transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**common, **linear)
        ),
        "attention": transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
    }
    paths = {}
    for name, model in models.items():
        paths[name] = directory / name
        model.save_pretrained(paths[name], safe_serialization=True)
    return paths


def _measure(path: Path, name: str, dtype: str, settings: HybridSettings) -> list[HybridPoint]:
    longest, widest = max(settings.contexts), max(settings.batch_sizes)
    llm = LLM(
        model=str(path),
        dtype=dtype,
        max_model_len=longest + settings.timed_steps + 8 + prefill_steps(widest, longest, 2048),
        max_num_seqs=widest,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    points = []
    for context in settings.contexts:
        # Untimed first: kernels pick and cache their plans on a shape's first run.
        for batch in settings.batch_sizes:
            time_pure_decode(llm, batch, context, 1, rng, margin=_MARGIN, strict=False)
        prefills = []
        for _ in range(2):
            prompt = [rng.randrange(vocab) for _ in range(context)]
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            prefills.append(context / (time.perf_counter() - start))
        prefill = max(prefills)
        cache = context * kv_bytes_per_token(engine.model_config, engine.runner.kv_format)
        cache += state_bytes_per_sequence(engine.model_config, engine.dtype)
        for batch in settings.batch_sizes:
            steps = time_pure_decode(llm, batch, context, settings.timed_steps, rng, margin=_MARGIN)
            step = statistics.median(steps)
            points.append(
                HybridPoint(name, dtype, context, batch, prefill, step * 1e3, batch / step, cache)
            )
    del llm, engine
    gc.collect()
    return points


def run_hybrid_bench(settings: HybridSettings) -> dict[str, Any]:
    points: list[HybridPoint] = []
    with tempfile.TemporaryDirectory() as scratch:
        paths = build_models(Path(scratch), settings.tiny)
        for dtype in settings.dtypes:
            for name, path in paths.items():
                points += _measure(path, name, dtype, settings)
    return {
        "benchmark": "hybrid",
        "threads": torch.get_num_threads(),
        "cpu_flags": cpu_flags(),
        "settings": asdict(settings),
        "points": [asdict(p) for p in points],
        "ratios": ratios(points),
    }


def ratios(points: list[HybridPoint]) -> list[dict[str, Any]]:
    """Hybrid over attention twin, per (dtype, context, batch): above 1 the hybrid is faster."""
    twins = {(p.dtype, p.context, p.batch_size): p for p in points if p.model == "attention"}
    rows = []
    for p in points:
        twin = twins.get((p.dtype, p.context, p.batch_size))
        if p.model != "hybrid" or twin is None:
            continue
        rows.append({
            "dtype": p.dtype, "context": p.context, "batch_size": p.batch_size,
            "prefill": p.prefill_tokens_per_s / twin.prefill_tokens_per_s,
            "decode": p.decode_tokens_per_s / twin.decode_tokens_per_s,
            "cache_bytes": p.cache_bytes_per_sequence / twin.cache_bytes_per_sequence,
        })  # fmt: skip
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    tiny = report["settings"]["tiny"]
    size = (
        "a toy shape (4 layers, hidden 64)"
        if tiny
        else ("the default model's size (30 layers, hidden 576)")
    )
    lines = [
        "# Hybrid (Gated DeltaNet) vs all-attention twin",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['threads']} threads, CPU flags: {' '.join(report['cpu_flags']) or 'n/a'}. "
        f"Random models of {size}: the hybrid has 3 Gated DeltaNet layers for every "
        "full-attention one. Prefill: one prompt of the context's length; decode: the median "
        "step in which every request decodes one token.",
        "",
        "| model | dtype | context | batch | prefill tok/s | decode step (ms) | decode tok/s "
        "| cache per sequence (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['model']} | {p['dtype']} | {p['context']} | {p['batch_size']} | "
            f"{p['prefill_tokens_per_s']:.0f} | {p['decode_step_ms']:.1f} | "
            f"{p['decode_tokens_per_s']:.1f} | {p['cache_bytes_per_sequence'] / 2**20:.2f} |"
        )
    lines += [
        "",
        "Hybrid over twin: prefill and decode above 1 mean the hybrid is faster; cache bytes "
        "is its cache per sequence over the twin's.",
        "",
        "| dtype | context | batch | prefill | decode | cache bytes |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["ratios"]:
        lines.append(
            f"| {r['dtype']} | {r['context']} | {r['batch_size']} | {r['prefill']:.2f}x | "
            f"{r['decode']:.2f}x | {r['cache_bytes']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(report, out_dir, "hybrid", render_markdown, None)
