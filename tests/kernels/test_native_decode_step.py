"""The native decode step (forklift/native/csrc/decode_step.c): one call runs a whole
decode step of a Llama-family or Gemma 3 model. In fp32 it equals the PyTorch layers
running the same block-quantized matmuls (the reference: same weights, same activation
quantization), token for token, on every architecture it runs (Gemma 3's sliding-window
layers in their own KV groups); it falls back to that path for steps it does not cover,
and follows the weights through updates."""

from __future__ import annotations

import logging

import pytest
from kernel_oracles import assert_same_steps
from tiny_models import make_tiny_model, save_with_weight

from forklift import LLM, SamplingParams
from forklift.model.layers.quantized import BLOCK_MAX_ROWS
from forklift.native import build as native_build
from forklift.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    native_build.find_compiler() is None, reason="no C compiler on this machine"
)

ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma3"]


def _int4_engine(path, **kwargs) -> LLM:
    common = dict(model=str(path), dtype="float32", quantization="int4", max_model_len=256,
                  block_size=4, kv_cache_memory_bytes=2**20, max_num_seqs=32)  # fmt: skip
    return LLM(**{**common, **kwargs})


def _without_native_step(llm: LLM) -> LLM:
    """The same engine's PyTorch layers (with the same native block matmuls)."""
    llm.llm_engine.runner.native_step = None
    return llm


def _generate(llm: LLM, prompts, tokens: int = 20, n: int = 1):
    params = SamplingParams(n=n, temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o for out in outs for o in out.outputs]


@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_equals_the_pytorch_layers(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    native = _int4_engine(tmp_path)
    reference = _without_native_step(_int4_engine(tmp_path))
    assert native.llm_engine.runner.native_step is not None
    prompts = [[5 + i, 17, 3 * i + 1, 40, 9][: 2 + i] for i in range(5)]
    got = _generate(native, prompts)
    want = _generate(reference, prompts)
    assert_same_steps(got, want)
    assert native.llm_engine.runner.native_steps >= 19  # every decode step of the batch
    assert reference.llm_engine.runner.native_steps == 0


def test_native_steps_of_many_rows_keep_each_rows_result(tmp_path):
    """More rows than the PyTorch layers' block kernels take, prompts and decodes alike: the
    native step runs them all, and each row comes out bit for bit as in smaller steps."""
    make_tiny_model("llama", tmp_path)
    prompts = [[3 + i, 11, 7 + i % 5, *range(20, 34)] for i in range(BLOCK_MAX_ROWS + 5)]
    together = _int4_engine(tmp_path)
    rows = _generate(together, prompts, 6)
    assert together.llm_engine.runner.native_steps == 6  # the prompts, then 5 of 21 rows
    apart = _int4_engine(tmp_path, max_num_seqs=4)
    for a, b in zip(rows, _generate(apart, prompts, 6), strict=True):
        assert a.token_ids == b.token_ids
        assert [s[t].logprob for t, s in zip(a.token_ids, a.logprobs, strict=True)] == [
            s[t].logprob for t, s in zip(b.token_ids, b.logprobs, strict=True)
        ]


def test_the_dense_copies_are_dropped(tmp_path):
    """Every step runs the blocks, so no dense copy of a block weight stays in memory."""
    make_tiny_model("llama", tmp_path)
    runner = _int4_engine(tmp_path).llm_engine.runner
    layer = runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.is_meta and layer.mlp.down_proj.weight.is_meta
    assert runner.quantization_report.dense_bytes == 0
    blocks = runner.model.packed_bytes()
    assert runner.weight_bytes < blocks + 2 * runner.model.embed_tokens.weight.nbytes


def test_native_step_follows_weight_updates(tmp_path):
    tiny = make_tiny_model("qwen3", tmp_path / "a")
    llm = _int4_engine(tmp_path / "a")
    prompts = [[9, 4, 21], [30, 2]]
    before = _generate(llm, prompts)
    name = "model.layers.1.mlp.down_proj.weight"
    changed = -0.5 * tiny.hf_model.state_dict()[name]
    llm.update_weights([(name, changed)])
    save_with_weight(tiny, tmp_path / "a", tmp_path / "b", name, changed)
    after = _generate(llm, prompts)
    fresh = _generate(_int4_engine(tmp_path / "b"), prompts)
    assert_same_steps(after, fresh)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before, strict=True))


def test_n_samples_and_prefix_caching_on_the_native_step(tmp_path):
    make_tiny_model("qwen2", tmp_path)
    native = _int4_engine(tmp_path, enable_prefix_caching=True)
    reference = _without_native_step(_int4_engine(tmp_path, enable_prefix_caching=True))
    prefix = [7, 3, 9, 11, 4, 8, 15, 2]
    prompts = [prefix + [20 + i] for i in range(3)]
    for _ in range(2):  # the second round hits the cache
        assert_same_steps(
            _generate(native, prompts, 12, n=2), _generate(reference, prompts, 12, n=2)
        )
    assert native.llm_engine.prefix_cache_stats().hit_tokens > 0
    assert native.llm_engine.runner.native_steps > 0


def test_structured_outputs_hold_on_the_native_step(default_source):
    llm = LLM(model=str(default_source.path), max_model_len=256,
              kv_cache_memory_bytes=16 * 2**20)  # fmt: skip
    assert llm.llm_engine.runner.native_step is not None
    choices = ["warehouse", "harbour", "airport"]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))  # fmt: skip
    outs = llm.generate(["Where do forklifts work? Answer:"] * 3, params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    assert llm.llm_engine.runner.native_steps > 0


def test_the_log_says_which_decode_step_runs(tmp_path, caplog):
    make_tiny_model("llama", tmp_path)
    with caplog.at_level(logging.INFO, logger="forklift"):
        _int4_engine(tmp_path)
        _int4_engine(tmp_path, decode_backend="torch")
        _int4_engine(tmp_path, quantization="none")
    assert "every step: one native call" in caplog.text
    assert "quantization int4 (PyTorch kernels)" in caplog.text
    with pytest.raises(ValueError, match="decode_backend"):
        _int4_engine(tmp_path, quantization="none", decode_backend="native")
