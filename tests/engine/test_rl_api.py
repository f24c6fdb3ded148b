"""The RL surface of the engine: weight updates, exact logprobs, sleep / wake, versions."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from test_engine import make_llm
from tiny_models import hf_greedy, make_tiny_model

from forklift import SamplingParams

PROMPTS = [[5, 17, 33, 9, 41, 12, 7, 88, 3, 60, 21, 14, 99, 45, 6, 30, 72, 11], [8, 200, 31]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-rl"))


@pytest.fixture()
def llm(tiny):
    return make_llm(tiny.path)


def perturbed_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def greedy_ids(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def hf_ids(model: torch.nn.Module) -> list[list[int]]:
    return [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in PROMPTS]


def test_update_weights_matches_hf_and_restores(llm, tiny):
    original = {k: v.clone() for k, v in tiny.hf_model.state_dict().items()}
    before = greedy_ids(llm)
    assert before == hf_ids(tiny.hf_model)
    new_state = perturbed_state(tiny.hf_model, seed=1)
    # Any order, streamed in two pieces, in bf16 (cast to the engine's dtype).
    items = list(reversed(new_state.items()))
    half = len(items) // 2
    assert llm.update_weights(((k, v.to(torch.bfloat16)) for k, v in items[:half]), False)
    assert llm.update_weights(items[half:]) == len(new_state)
    assert llm.weight_version == 1
    perturbed_hf = copy.deepcopy(tiny.hf_model)
    perturbed_hf.load_state_dict(
        {
            k: v.to(torch.bfloat16).float() if i < half else v for i, (k, v) in enumerate(items)
        }  # fmt: skip
    )
    after = greedy_ids(llm)
    assert after == hf_ids(perturbed_hf) and after != before
    outputs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert outputs[0].weight_version == 1
    llm.update_weights(original.items())
    assert greedy_ids(llm) == before
    assert llm.weight_version == 2


@pytest.mark.parametrize(
    ("name", "tensor", "message"),
    [
        ("model.layers.0.mlp.bogus.weight", torch.zeros(3), "unknown weight name"),
        ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64), "unknown weight name"),
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64), "shape"),
        ("model.embed_tokens.weight", torch.zeros(256, 64, dtype=torch.int32), "dtype"),
        ("model.norm.weight", torch.full((64,), float("nan")), "NaN"),
    ],
)
def test_bad_updates_are_refused_and_leave_the_weights_whole(llm, tiny, name, tensor, message):
    before = greedy_ids(llm)
    good = perturbed_state(tiny.hf_model, seed=2)
    # A good piece staged first is dropped together with the bad one.
    llm.update_weights(list(good.items())[:5], finalize=False)
    with pytest.raises(ValueError, match=message):
        llm.update_weights([("model.norm.weight", good["model.norm.weight"]), (name, tensor)])
    assert llm.llm_engine.num_staged_weights == 0
    assert llm.weight_version == 0
    assert greedy_ids(llm) == before


def chosen_logprobs(sample) -> list[float]:
    by_dict = [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
    assert sample.sampled_logprobs == by_dict
    return by_dict


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_hf_log_softmax(llm, tiny, temperature):
    params = SamplingParams(
        n=2, temperature=temperature, seed=3, max_tokens=12, ignore_eos=True, logprobs=0
    )
    raw_params = params.clone(logprobs_mode="raw")
    prompt = PROMPTS[0]
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    raw_output = llm.generate(prompt, raw_params, use_tqdm=False)[0]
    for sample, raw_sample in zip(output.outputs, raw_output.outputs, strict=True):
        assert sample.token_ids == raw_sample.token_ids  # the mode never changes the draw
        ids = torch.tensor([prompt + sample.token_ids])
        with torch.no_grad():
            logits = tiny.hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
        index = torch.tensor(sample.token_ids)[:, None]
        expected = torch.log_softmax(logits / temperature, -1).gather(1, index)[:, 0]
        expected_raw = torch.log_softmax(logits, -1).gather(1, index)[:, 0]
        got = torch.tensor(chosen_logprobs(sample))
        got_raw = torch.tensor(chosen_logprobs(raw_sample))
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
        torch.testing.assert_close(got_raw, expected_raw, atol=1e-3, rtol=0)


def test_sleep_frees_and_wake_up_restores(llm):
    engine = llm.llm_engine
    before = greedy_ids(llm)
    kv_bytes = engine.runner.kv_cache_bytes
    assert kv_bytes == engine.kv_plan.num_blocks * engine.kv_plan.bytes_per_block
    cache_ref = weakref.ref(engine.runner.cache.blocks)
    llm.sleep(1)
    assert engine.runner.kv_cache_bytes == 0 and cache_ref() is None  # the storage is gone
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert engine.runner.kv_cache_bytes == kv_bytes
    assert greedy_ids(llm) == before
    # The prefix cache works again after waking.
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep(2)
    assert sum(p.numel() for p in engine.runner.model.parameters()) == 0
    with pytest.raises(ValueError, match="wake_up"):
        llm.update_weights([])
    llm.wake_up()
    assert greedy_ids(llm) == before
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)


def test_a_weight_update_never_serves_old_blocks(llm, tiny):
    prompt = PROMPTS[0]
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 16
    llm.update_weights(perturbed_state(tiny.hf_model, seed=4).items())
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    assert second.weight_version == 1 and first.weight_version == 0
    assert llm.llm_engine.prefix_cache_stats().hit_tokens == 16
