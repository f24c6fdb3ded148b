"""Greedy fp32 parity with HF transformers for tiny random models of every architecture."""

from __future__ import annotations

import random
import zlib

import pytest
from tiny_models import ARCHITECTURES, VOCAB, hf_greedy, make_tiny_model

from forklift import LLM, SamplingParams

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 3, 7, 12, 20, 33, 50, 64]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_tokens_and_logprobs_match_transformers(arch, tmp_path):
    tiny = make_tiny_model(arch, tmp_path)
    # A seed fixed per architecture (str hashes change from process to process): random
    # tiny models have near-ties that fp32 rounding may flip, so the prompts stay put.
    prompts = _prompts(zlib.crc32(arch.encode()) % 1000)
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        max_model_len=256,
        block_size=4,
        kv_cache_memory_bytes=2**20,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs, strict=True):
        expected_tokens, expected_logprobs = hf_greedy(tiny.hf_model, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert got == pytest.approx(expected_logprobs, abs=1e-3)
        assert completion.finish_reason == "length"
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_usable_blocks
