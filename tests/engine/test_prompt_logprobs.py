"""SamplingParams.prompt_logprobs: every prompt token's logprob equals transformers'
teacher-forced one, whatever the prefill chunking, with n > 1 and on a prompt the prefix
cache holds."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import VOCAB, make_tiny_model

from forklift import LLM, SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-prompt-logprobs")
    model = make_tiny_model("llama", directory)
    # 16 tokens a step: the 40-token prompt is prefilled in three chunks.
    llm = LLM(model=str(directory), dtype="float32", max_model_len=128, block_size=4,
              kv_cache_memory_bytes=2**20, max_num_batched_tokens=16)  # fmt: skip
    return model.hf_model.float().eval(), llm


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(5, VOCAB) for _ in range(n)] for n in (40, 23, 7, 2)]


def _teacher_forced(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(hf_model, prompt: list[int], got) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    want = _teacher_forced(hf_model, prompt)
    for position in range(1, len(prompt)):
        entry, expected = got[position], want[position - 1]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= TOP)
        assert [t for _, t in top] == expected.topk(TOP).indices.tolist()


def test_prompt_logprobs_match_transformers_under_chunked_prefill(tiny):
    hf_model, llm = tiny
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        _check(hf_model, prompt, output.prompt_logprobs)
    plain = llm.generate({"prompt_token_ids": prompts[0]}, params.clone(prompt_logprobs=None),
                         use_tqdm=False)[0]  # fmt: skip
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_a_cached_prompt_is_scored_again_and_samples_share_one_list(tiny):
    hf_model, llm = tiny
    prompt = _prompts()[0]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)  # now in the cache
    hit = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0  # the cache is on and holds this prompt...
    scored = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=4, prompt_logprobs=TOP),
        use_tqdm=False,
    )[0]
    assert scored.num_cached_tokens == 0  # ...yet a scoring request computes every position
    assert len(scored.outputs) == 3
    _check(hf_model, prompt, scored.prompt_logprobs)


def test_prompt_logprobs_are_bounded_like_logprobs(tiny):
    _, llm = tiny
    for bad in (-1, 10**6):
        with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs"):
            llm.generate("w1 w2", SamplingParams(prompt_logprobs=bad), use_tqdm=False)


def test_each_request_keeps_its_own_number_of_top_tokens(tiny):
    """Rows of one step are scored with the most top tokens any request asked for; each
    request's entries hold its own top N (plus the prompt token itself)."""
    _, llm = tiny
    prompts = _prompts()[:2]
    asks = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=n) for n in (1, 6)]
    few, many = llm.generate([{"prompt_token_ids": p} for p in prompts], asks, use_tqdm=False)
    assert all(len(e) <= 2 for e in few.prompt_logprobs[1:])
    assert all(len(e) >= 6 for e in many.prompt_logprobs[1:])
