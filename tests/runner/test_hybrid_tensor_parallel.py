"""Tensor parallelism for the hybrid family: Gated DeltaNet heads split by key-head groups
across ranks (each rank its heads' states), full attention by KV heads, equal to one rank."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_cases import GREEDY, chosen_logprobs, hybrid_engine, hybrid_prompts
from tiny_models import make_tiny_hybrid

from forklift import SamplingParams
from forklift.checkpoint.tensors import layer_name
from forklift.model.model_config import ModelConfig
from forklift.model.tensor_parallel import TensorParallelShard

LINEAR_TENSORS = (
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
    "linear_attn.conv1d.weight", "linear_attn.dt_bias", "linear_attn.A_log",
    "linear_attn.out_proj.weight",
)  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hybrid("interval", tmp_path_factory.mktemp("hybrid-tp"))


def test_each_rank_holds_whole_head_groups_of_every_linear_tensor(model):
    config = ModelConfig.from_hf_config(json.loads((model.path / "config.json").read_text()))
    shards = [TensorParallelShard.plan(config, rank, 2) for rank in (0, 1)]
    state = model.hf_model.state_dict()
    layer = config.linear_layers[0]
    for name in LINEAR_TENSORS:
        full = state[layer_name(layer, name)]
        parts = [shard.shard(layer_name(layer, name), full, config) for shard in shards]
        axis = 1 if name.endswith("out_proj.weight") else 0
        assert sum(p.shape[axis] for p in parts) == full.shape[axis], name
        local = shards[0].local_config(config).linear_attention
        assert local is not None and local.num_key_heads == 1
    # Rank 1's queries, keys and values are the second halves of each of the three.
    qkv = state[layer_name(layer, "linear_attn.in_proj_qkv.weight")]
    shape = config.linear_attention
    key, value = shape.key_size, shape.value_size
    second = shards[1].shard(layer_name(layer, "linear_attn.in_proj_qkv.weight"), qkv, config)
    expected = torch.cat([qkv[key // 2 : key], qkv[key + key // 2 : 2 * key],
                          qkv[2 * key + value // 2 :]])  # fmt: skip
    assert torch.equal(second, expected)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_tp2_gives_the_tp1_outputs(model, caching):
    prompts = hybrid_prompts(30, [5, 23, 41])
    prompts.append(prompts[2][:36] + hybrid_prompts(31, [9])[0])  # a shared prefix, for the cache
    settings = dict(enable_prefix_caching=caching, kv_cache_memory_bytes=2**21)
    expected = hybrid_engine(model.path, **settings).generate(prompts, GREEDY, use_tqdm=False)
    llm = hybrid_engine(model.path, tensor_parallel_size=2, **settings)
    try:
        for params in (GREEDY, SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            if params is GREEDY:
                for output, reference in zip(outputs, expected, strict=True):
                    assert output.outputs[0].token_ids == reference.outputs[0].token_ids
                    assert chosen_logprobs(output) == pytest.approx(
                        chosen_logprobs(reference), abs=1e-4
                    )
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp2_adds_attention_biases_once(tmp_path):
    # The sandwich layout, whose linear layers group no value heads, with biased attention.
    tiny = make_tiny_hybrid("sandwich", tmp_path, attention_bias=True)
    with torch.no_grad():  # HF starts biases at zero: make them count
        for name, param in tiny.hf_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    tiny.hf_model.save_pretrained(tmp_path, safe_serialization=True)
    prompts = hybrid_prompts(32, [6, 19])
    expected = hybrid_engine(tmp_path).generate(prompts, GREEDY, use_tqdm=False)
    llm = hybrid_engine(tmp_path, tensor_parallel_size=2)
    try:
        for output, reference in zip(
            llm.generate(prompts, GREEDY, use_tqdm=False), expected, strict=True
        ):
            assert output.outputs[0].token_ids == reference.outputs[0].token_ids
            assert chosen_logprobs(output) == pytest.approx(chosen_logprobs(reference), abs=1e-4)
    finally:
        llm.shutdown()
