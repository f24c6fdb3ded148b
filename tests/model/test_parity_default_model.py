"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in fp32 matches HF transformers.

The oracle is transformers' LlamaForCausalLM holding the same dequantized weights, so this
checks forklift's model, paged attention and batching; tests/model/test_loaders.py checks the
dequantization and q/k un-permutation against transformers' own GGUF code.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_teacher_forced

from forklift import SamplingParams
from forklift.hf_reference import load_hf_model
from forklift.model.model_source import load_model_config

# The default model end to end against transformers, both sides in fp32.
pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a short poem about the sea and the wind that moves across it at night.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "The quick brown fox",
    "Explain in one sentence why the sky is blue, then explain why sunsets are red and "
    "what role the atmosphere plays in scattering light of different wavelengths.",
    "Compute 12 + 30 and show your work step by step.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_oracle(default_source):
    # transformers' LlamaForCausalLM holding forklift's dequantized weights.
    return load_hf_model(default_source, load_model_config(default_source), torch.float32)


def test_default_model_greedy_parity(default_llm_fp32, hf_oracle):
    llm = default_llm_fp32
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompt_ids = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations
    ]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS)  # all lengths differ
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    for prompt, output in zip(prompt_ids, outputs, strict=True):
        completion = output.outputs[0]
        # HF's greedy continuation: its argmax at every position of forklift's tokens.
        scores = hf_teacher_forced(hf_oracle, prompt, completion.token_ids)
        expected_tokens = scores.argmax(dim=-1).tolist()
        assert completion.token_ids == expected_tokens
        expected_logprobs = [scores[i, t].item() for i, t in enumerate(expected_tokens)]
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert got == pytest.approx(expected_logprobs, abs=1e-3)
        # Greedy picks the top token: its rank is 1 and it heads the top-2 list.
        assert all(completion.logprobs[i][t].rank == 1 for i, t in enumerate(expected_tokens))
    assert "Paris" in outputs[0].outputs[0].text


def test_multiple_choice_scores_through_the_completions_api_match_transformers(
    default_source, hf_oracle
):
    """As an evaluation harness scores a task: each choice's summed continuation logprob from
    `echo`, `logprobs` and `max_tokens: 0` on the completions API, against transformers'
    teacher-forced sum; both pick the same choices."""
    import json
    from pathlib import Path

    import openai
    from server_harness import running_server

    from forklift.config import EngineConfig
    from forklift.engine.engine import LLMEngine
    from forklift.server.app import build_app

    config = EngineConfig(model=str(default_source.path), dtype="float32", max_model_len=256,
                          kv_cache_memory_bytes=32 * 2**20)  # fmt: skip
    engine = LLMEngine(config)
    tokenizer = engine.tokenizer
    tasks = json.loads((Path(__file__).parents[1] / "data" / "multiple_choice.json").read_text())
    picked = {"api": [], "hf": []}
    with running_server(build_app(engine, "smol")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for task in tasks:
            context = tokenizer.encode(task["context"], add_special_tokens=False)
            scores = {"api": [], "hf": []}
            for choice in task["choices"]:
                continuation = tokenizer.encode(choice, add_special_tokens=False)
                ids = context + continuation
                reply = client.completions.create(
                    model="smol", prompt=ids, echo=True, max_tokens=0, logprobs=1
                ).choices[0]
                assert reply.finish_reason == "length"
                logprobs = reply.logprobs
                assert len(logprobs.token_logprobs) == len(ids)
                assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
                assert reply.text == tokenizer.decode(ids, skip_special_tokens=False)
                scores["api"].append(sum(logprobs.token_logprobs[-len(continuation) :]))
                with torch.no_grad():
                    logits = hf_oracle(torch.tensor([ids])).logits[0].float()
                teacher = torch.log_softmax(logits, dim=-1)
                positions = range(len(context) - 1, len(ids) - 1)
                scores["hf"].append(sum(teacher[p, ids[p + 1]].item() for p in positions))
            assert scores["api"] == pytest.approx(scores["hf"], abs=2e-3)
            for side in picked:
                picked[side].append(max(range(len(task["choices"])), key=scores[side].__getitem__))
    assert picked["api"] == picked["hf"]
    assert sum(p == t["answer"] for p, t in zip(picked["api"], tasks, strict=True)) >= 3
