"""A KV cache in bf16 under a model computing in fp32: kv_cache_dtype "bfloat16", and what
"auto" settles to on a CPU when no dtype is asked for (an AVX2-only CPU computes in fp32).

- Settling "auto": bf16 on a CPU unless a dtype was asked for; the explicit names kept.
- Through the engine: twice the tokens of an fp32 cache in the same bytes; the native step
  and the PyTorch layers write and read the same rows; close to an fp32 cache; the hybrid
  family (its attention layers on the PyTorch path) on it; the default model on its defaults.
  The invariance of a request's tokens on this cache: test_batch_invariance.py's int4-kv-bf16
  form.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import step_deviations
from test_batch_invariance import _prompt, _result
from tiny_models import make_tiny_hybrid, make_tiny_model

from forklift import LLM, SamplingParams
from forklift.config import EngineConfig
from forklift.cpu import cpu_has_fast_bf16
from forklift.engine.snapshot import take_snapshot
from forklift.model.kv_cache_dtype import kv_cache_format
from forklift.native import build as native_build

needs_compiler = pytest.mark.skipif(
    native_build.find_compiler() is None, reason="no C compiler on this machine"
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
CPU = torch.device("cpu")


def test_auto_settles_to_bf16_on_a_cpu_unless_a_dtype_is_asked_for():
    assert EngineConfig().resolve_kv_cache_dtype(CPU) == "bfloat16"
    assert EngineConfig(dtype="float32").resolve_kv_cache_dtype(CPU) == "auto"
    assert EngineConfig(dtype="bfloat16").resolve_kv_cache_dtype(CPU) == "auto"
    assert EngineConfig().resolve_kv_cache_dtype(torch.device("cuda")) == "auto"
    for name in ("bfloat16", "float32", "int8"):
        assert (
            EngineConfig(dtype="float32", kv_cache_dtype=name).resolve_kv_cache_dtype(CPU) == name
        )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float16")


def test_the_plain_names_keep_their_dtype_whatever_the_model_computes_in():
    bf16 = kv_cache_format("bfloat16", torch.float32)
    assert (bf16.name, bf16.storage, bf16.row_bytes(64)) == ("bfloat16", torch.bfloat16, 128)
    assert not bf16.quantized
    fp32 = kv_cache_format("float32", torch.bfloat16)
    assert (fp32.name, fp32.storage, fp32.row_bytes(64)) == ("float32", torch.float32, 256)
    assert kv_cache_format("auto", torch.float32).storage == torch.float32


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path)
    return path


def _engine(path, **kwargs) -> LLM:
    common = dict(model=str(path), dtype="float32", quantization="int4", max_model_len=512,
                  block_size=4, kv_cache_memory_bytes=2**21, max_num_seqs=64,
                  kv_cache_dtype="bfloat16")  # fmt: skip
    return LLM(**{**common, **kwargs})


def test_the_same_bytes_hold_twice_the_tokens_of_an_fp32_cache(tiny):
    bf16 = _engine(tiny).llm_engine
    fp32 = _engine(tiny, kv_cache_dtype="auto").llm_engine
    assert fp32.runner.kv_format.storage == torch.float32
    assert bf16.runner.kv_format.storage == torch.bfloat16
    ratio = bf16.kv_plan.token_capacity / fp32.kv_plan.token_capacity
    assert ratio == pytest.approx(2, rel=0.02)
    config = take_snapshot(bf16).config  # what /status shows
    assert config["kv_cache_dtype"] == "bfloat16"
    assert config["kv_cache_tokens"] == bf16.kv_plan.token_capacity


@needs_compiler
def test_the_native_step_and_the_pytorch_layers_read_the_cache_alike(tiny):
    """The reference path (PyTorch layers on the same block matmuls: rows rounded to bf16 as
    they are written, widened as they are read) gives the native step's tokens and, but for
    activations that round the other way, its logprobs; the bf16 cache stays close to the
    fp32 one."""
    prompts = [_prompt(40), _prompt(9, salt=2)]
    native_llm = _engine(tiny)
    reference_llm = _engine(tiny)
    reference_llm.llm_engine.runner.native_step = None

    def run(llm: LLM):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    native, reference = run(native_llm), run(reference_llm)
    assert native_llm.llm_engine.runner.native_steps > 0
    assert reference_llm.llm_engine.runner.native_steps == 0
    deviations = step_deviations(native, reference)
    assert deviations[-1] < 0.05 and deviations[len(deviations) * 3 // 4] < 2e-3, deviations
    # A tiny random model's first choices can be near ties, which bf16 rows may flip: the
    # first step's top tokens and their logprobs are compared, not the tokens chosen.
    fp32 = run(_engine(tiny, kv_cache_dtype="float32"))
    for a, b in zip(native, fp32, strict=True):
        shared = a.logprobs[0].keys() & b.logprobs[0].keys()
        assert len(shared) >= 2
        for token in shared:
            assert a.logprobs[0][token].logprob == pytest.approx(
                b.logprobs[0][token].logprob, abs=0.1
            )


def test_the_hybrid_family_runs_on_a_bf16_cache(tmp_path):
    """Its attention layers write fp32 K/V into bf16 rows and read them back widened;
    chunked prefill alike."""
    make_tiny_hybrid("interval", tmp_path)
    prompt = _prompt(30)
    common = dict(quantization="auto", max_num_batched_tokens=16, max_num_seqs=16)
    bf16 = _engine(tmp_path, **common)
    assert bf16.llm_engine.runner.kv_format.storage == torch.bfloat16
    got = _result(bf16, prompt, GREEDY)
    fp32 = _result(_engine(tmp_path, kv_cache_dtype="auto", **common), prompt, GREEDY)
    shared = got[1][0].keys() & fp32[1][0].keys()
    assert len(shared) >= 2
    for token in shared:
        assert got[1][0][token] == pytest.approx(fp32[1][0][token], abs=0.1)


@needs_compiler
def test_the_default_model_keeps_its_cache_in_bf16_on_its_defaults(default_source):
    """On every CPU kind: half the bytes of an fp32 cache per token, and the same answer from
    the prefix cache as computed afresh."""

    def engine(**kwargs) -> LLM:
        return LLM(model=str(default_source.path), max_model_len=512,
                   kv_cache_memory_bytes=32 * 2**20, **kwargs)  # fmt: skip

    llm = engine(enable_prefix_caching=True)
    runner = llm.llm_engine.runner
    assert runner.kv_format.name == "bfloat16"
    assert runner.dtype == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    fp32 = engine(kv_cache_dtype="float32").llm_engine
    assert fp32.kv_plan.bytes_per_block == 2 * llm.llm_engine.kv_plan.bytes_per_block
    prompt = llm.get_tokenizer().encode("Name three colours of a forklift.")
    prompt = prompt + prompt[1:] + prompt[1:]
    fresh = _result(llm, prompt, GREEDY)
    assert _result(llm, prompt, GREEDY) == fresh
    assert llm.llm_engine.prefix_cache_stats().hit_tokens >= 16
