"""Qwen3.5 hybrid models (Gated DeltaNet + gated full attention) against HF transformers."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_cases import (
    GREEDY,
    NEW_TOKENS,
    assert_matches_hf,
    assert_nothing_held,
    hybrid_engine,
    hybrid_prompts,
)
from safetensors.torch import load_file, save_file
from tiny_models import HYBRID_VARIANTS, hf_greedy, make_tiny_hybrid

from forklift import SamplingParams


@pytest.fixture(scope="module")
def interval_model(tmp_path_factory):
    return make_tiny_hybrid("interval", tmp_path_factory.mktemp("hybrid-interval"))


@pytest.mark.parametrize("variant", list(HYBRID_VARIANTS))
def test_greedy_batch_matches_transformers_under_chunked_prefill(variant, tmp_path):
    tiny = make_tiny_hybrid(variant, tmp_path)
    prompts = hybrid_prompts(len(variant))
    llm = hybrid_engine(tmp_path)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(tiny.hf_model, prompts, outputs)
    assert_nothing_held(llm)


def test_one_chunk_and_many_chunks_agree(interval_model):
    prompts = hybrid_prompts(1, [70, 45])
    whole = hybrid_engine(interval_model.path, max_num_batched_tokens=256).generate(
        prompts, GREEDY, use_tqdm=False
    )
    chunked = hybrid_engine(interval_model.path, max_num_batched_tokens=8).generate(
        prompts, GREEDY, use_tqdm=False
    )
    for a, b in zip(whole, chunked, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = [a.outputs[0].logprobs[i][t].logprob for i, t in enumerate(a.outputs[0].token_ids)]
        lp_b = [b.outputs[0].logprobs[i][t].logprob for i, t in enumerate(b.outputs[0].token_ids)]
        assert lp_a == pytest.approx(lp_b, abs=1e-4)


def test_preemption_drops_the_state_and_recomputes(interval_model):
    prompts = hybrid_prompts(2, [30, 28, 26, 24, 22, 20])
    # 1 KiB of KV per block of 4 tokens and 7.3 KiB of state per sequence: this budget holds
    # 6 state slots and 55 blocks, but six sequences growing to 46 tokens need 72 blocks, so
    # the newest are preempted and recomputed.
    llm = hybrid_engine(interval_model.path, kv_cache_memory_bytes=110_000, max_model_len=128)
    engine = llm.llm_engine
    assert engine.state_pool.num_slots == 6
    assert engine.num_usable_blocks < 72
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(interval_model.hf_model, prompts, outputs)
    assert_nothing_held(llm)


def test_samples_fork_the_prompt_state(interval_model):
    prompt = hybrid_prompts(3, [23])[0]
    llm = hybrid_engine(interval_model.path)
    greedy_n = SamplingParams(n=4, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = llm.generate([prompt], greedy_n, use_tqdm=False)
    expected, _ = hf_greedy(interval_model.hf_model, prompt, NEW_TOKENS)
    assert [c.token_ids for c in out.outputs] == [expected] * 4
    # 23 tokens in blocks of 4: the leader's first chunk stops at the 20 tokens the samples
    # share; then each of the four computes only the last 3 from its copy of that state.
    steps = [s.num_batched_tokens for s in llm.llm_engine.step_log]
    assert steps[:2] == [20, 4 * 3], steps
    assert_nothing_held(llm)


def test_seeded_samples_are_the_same_alone_and_in_a_batch(interval_model):
    prompt = hybrid_prompts(4, [41])[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = hybrid_engine(interval_model.path)
    (alone,) = llm.generate([prompt], params, use_tqdm=False)
    others = hybrid_prompts(5, [9, 33, 17])
    batch = llm.generate(
        [others[0], prompt, others[1], others[2]],
        [GREEDY, params, GREEDY, GREEDY],
        use_tqdm=False,
    )
    assert [c.token_ids for c in batch[1].outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # they do sample
    assert_matches_hf(interval_model.hf_model, [others[0]], [batch[0]])
    assert_nothing_held(llm)


def test_aborts_give_back_blocks_and_state_slots(interval_model):
    llm = hybrid_engine(interval_model.path)
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(hybrid_prompts(7, [30, 5, 60, 13])):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(6):
        engine.step()
    assert engine.state_pool.num_free < engine.state_pool.num_slots
    engine.abort_request([f"r{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    assert_nothing_held(llm)


def test_update_weights_and_sleep_keep_parity(tmp_path):
    first = make_tiny_hybrid("sandwich", tmp_path / "a", seed=0)
    second = make_tiny_hybrid("sandwich", tmp_path / "b", seed=1)
    prompts = hybrid_prompts(8, [5, 27])
    llm = hybrid_engine(first.path)
    llm.update_weights(list(second.hf_model.state_dict().items()))
    assert_matches_hf(second.hf_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    llm.sleep(level=2)
    llm.wake_up()  # reloads the weights from disk: the first model again
    assert_matches_hf(first.hf_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_an_update_with_a_wrong_shape_is_refused(interval_model):
    llm = hybrid_engine(interval_model.path)
    with pytest.raises(ValueError, match="in_proj_z"):
        llm.update_weights([("model.layers.0.linear_attn.in_proj_z.weight", torch.zeros(3, 64))])


def test_vision_language_checkpoint_loads_its_text_model(interval_model, tmp_path, caplog):
    """A Qwen3_5ForConditionalGeneration directory: nested text_config, prefixed names."""
    config = json.loads((interval_model.path / "config.json").read_text())
    config.pop("architectures")
    wrapped = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": config["tie_word_embeddings"],
        "text_config": config,
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = load_file(interval_model.path / "model.safetensors")
    renamed = {
        (n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
        for n, t in tensors.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    save_file(renamed, tmp_path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((interval_model.path / name).read_bytes())
    prompts = hybrid_prompts(9, [11])
    with caplog.at_level("INFO", logger="forklift"):
        llm = hybrid_engine(tmp_path)
    assert "ignored 1 checkpoint tensors" in caplog.text
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(interval_model.hf_model, prompts, outputs)


def test_a_qwen3_5_model_without_linear_layers_keeps_its_gated_attention(tmp_path):
    layers = ["full_attention"] * 4
    tiny = make_tiny_hybrid("interval", tmp_path, layer_types=layers)
    prompts = hybrid_prompts(11, [6, 30])
    llm = hybrid_engine(tmp_path)
    assert llm.llm_engine.state_pool is None  # no linear layer, no state
    assert_matches_hf(tiny.hf_model, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_more_ranks_than_linear_key_heads_is_a_clear_error(tmp_path):
    make_tiny_hybrid("odd-heads", tmp_path)  # one linear-attention key head
    with pytest.raises(ValueError, match="exceeds the model's 1 linear-attention key heads"):
        hybrid_engine(tmp_path, tensor_parallel_size=2)


def test_a_budget_without_room_for_a_state_is_refused(interval_model):
    with pytest.raises(ValueError, match="state slot"):
        hybrid_engine(interval_model.path, kv_cache_memory_bytes=4096)


def test_the_server_streams_a_hybrid_model(interval_model):
    import openai
    from server_harness import running_server, wait_until_idle

    from forklift.config import EngineConfig
    from forklift.engine.engine import LLMEngine
    from forklift.server.app import build_app

    engine = LLMEngine(
        EngineConfig(model=str(interval_model.path), dtype="float32", max_model_len=256,
                     kv_cache_memory_bytes=2**21, max_num_batched_tokens=32)
    )  # fmt: skip
    prompt = hybrid_prompts(10, [37])[0]
    expected, _ = hf_greedy(interval_model.hf_model, prompt, NEW_TOKENS)
    with running_server(build_app(engine, "hybrid")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="hybrid", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, n=2,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts = ["", ""]
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        wait_until_idle(engine)
    expected_text = " ".join(f"w{t}" for t in expected)
    assert [t.split() for t in texts] == [expected_text.split()] * 2
    assert engine.state_pool.num_free == engine.state_pool.num_slots


QWEN3_5_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["linear_attention"] * 3}, "layer_types names 3 layers"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "unsupported layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ],
)
def test_bad_hybrid_configs_are_refused_naming_the_field(change, message):
    from forklift.model.model_config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**QWEN3_5_CONFIG, **change})
    # The same settings without the change parse, placing a full layer every fourth.
    config = ModelConfig.from_hf_config(QWEN3_5_CONFIG)
    assert config.attention_layers == (3,) and config.linear_layers == (0, 1, 2)
