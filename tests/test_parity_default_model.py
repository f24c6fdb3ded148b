"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in fp32 matches HF transformers.

The oracle is transformers' LlamaForCausalLM holding the same dequantized weights, so this
checks forklift's model, paged attention and batching; tests/test_loaders.py checks the
dequantization and q/k un-permutation against transformers' own GGUF code.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy

from forklift import SamplingParams
from forklift.hf_reference import load_hf_model
from forklift.model.model_source import load_model_config

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
        tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False)
        for c in conversations
    ]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS)  # all lengths differ
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    for prompt, output in zip(prompt_ids, outputs, strict=True):
        with torch.no_grad():
            expected_tokens, expected_logprobs = hf_greedy(hf_oracle, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert got == pytest.approx(expected_logprobs, abs=1e-3)
        # Greedy picks the top token: its rank is 1 and it heads the top-2 list.
        assert all(completion.logprobs[i][t].rank == 1 for i, t in enumerate(expected_tokens))
    assert "Paris" in outputs[0].outputs[0].text
