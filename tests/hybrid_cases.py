"""What the hybrid family's tests share: random prompts, a small fp32 engine that prefills in
chunks, greedy sampling with logprobs, and the checks against HF transformers."""

from __future__ import annotations

import random

import pytest
from tiny_models import VOCAB, hf_greedy

from forklift import LLM, SamplingParams

NEW_TOKENS = 16
PROMPT_LENGTHS = [1, 3, 7, 12, 20, 33, 50, 70]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def hybrid_prompts(seed: int, lengths: list[int] = PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def hybrid_engine(path, **overrides) -> LLM:
    kwargs = dict(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        block_size=4,
        kv_cache_memory_bytes=2**21,
        max_num_batched_tokens=32,  # prompts longer than this are prefilled in chunks
    )
    return LLM(**{**kwargs, **overrides})


def chosen_logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]


def assert_matches_hf(hf_model, prompts, outputs) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        assert chosen_logprobs(output) == pytest.approx(logprobs, abs=1e-3)


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.num_free_blocks == engine.num_usable_blocks
    assert engine.state_pool is not None
    assert engine.state_pool.num_free == engine.state_pool.num_slots
