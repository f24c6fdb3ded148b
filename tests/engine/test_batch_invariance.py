"""One forward for every step: a request's tokens and logprobs are bitwise the same whatever
shares its steps, however its prompt was chunked, and whatever of it the prefix cache held.

Every step of a model on native block weights, or on dense bf16 weights where the CPU has
AMX tiles or AVX512-BF16, runs the native step (prefill chunks, decode rows, mixed steps),
and each of its operations computes a row alone or in one fixed order per row, so these
comparisons are exact (==), not within a tolerance."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from forklift import LLM, SamplingParams
from forklift.native import build as native_build
from forklift.native.dense_weights import DenseMatmulKernel

pytestmark = pytest.mark.skipif(
    native_build.find_compiler() is None, reason="no C compiler on this machine"
)

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# Each architecture on int4 blocks; two also over a bf16 KV cache (the CPU default where
# the model computes in fp32); three also as dense bf16 weights (AMX tiles or AVX512-BF16).
FORMS = {
    "int4": dict(dtype="float32", quantization="int4"),
    "int4-kv-bf16": dict(dtype="float32", quantization="int4", kv_cache_dtype="bfloat16"),
    "bf16": dict(dtype="bfloat16", quantization="none"),
}
DENSE_TILES = native_build.find_compiler() is not None and DenseMatmulKernel.load() is not None
TINY = (
    [(arch, "int4") for arch in ARCHS]
    + [(arch, "int4-kv-bf16") for arch in ("llama", "gemma3")]
    + [
        pytest.param(
            (arch, "bf16"),
            marks=pytest.mark.skipif(not DENSE_TILES, reason="no dense bf16 kernel here"),
        )
        for arch in ("llama", "qwen3", "gemma3")
    ]
)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=3)


@dataclasses.dataclass(frozen=True)
class Tiny:
    path: Path
    form: str  # a key of FORMS


def _tiny_engine(tiny: Tiny, **kwargs) -> LLM:
    common = dict(model=str(tiny.path), max_model_len=512, block_size=4,
                  kv_cache_memory_bytes=2**21, max_num_seqs=64, **FORMS[tiny.form])  # fmt: skip
    return LLM(**{**common, **kwargs})


def _result(llm: LLM, prompt: list[int], params: SamplingParams, others=()):
    """The target's (tokens, logprobs) run beside `others` (prompts submitted with it)."""
    requests = [{"prompt_token_ids": prompt}] + [{"prompt_token_ids": p} for p in others]
    out = llm.generate(requests, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [3 + (7 * i + 5 * salt) % 90 for i in range(length)]


@pytest.fixture(scope="module", params=TINY, ids=lambda p: "-".join(p))
def tiny(request, tmp_path_factory) -> Tiny:
    arch, form = request.param
    path = tmp_path_factory.mktemp(arch)
    make_tiny_model(arch, path)
    return Tiny(path, form)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_beside_others_chunked_and_cached(tiny, params):
    prompt = _prompt(60)
    alone = _result(_tiny_engine(tiny), prompt, params)
    assert len(alone[0]) == params.max_tokens
    busy = _tiny_engine(tiny)
    for count in (1, 7, 40):  # prefills and decodes of others in the same steps
        others = [_prompt(5 + 3 * i, salt=i + 1) for i in range(count)]
        assert _result(busy, prompt, params, others) == alone, f"beside {count} others"
    for chunk in (16, 256):
        chunked = _tiny_engine(tiny, max_num_batched_tokens=chunk, max_num_seqs=16)
        assert _result(chunked, prompt, params) == alone, f"chunked at {chunk}"
    for cached in (16, 32, 48):
        llm = _tiny_engine(tiny, enable_prefix_caching=True)
        _result(llm, prompt[:cached] + _prompt(4, salt=9), GREEDY)
        got = _result(llm, prompt, params)
        assert llm.llm_engine.prefix_cache_stats().hit_tokens >= cached
        assert got == alone, f"{cached} tokens cached"


def test_same_tokens_under_preemption(tiny):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    prompt = _prompt(12)
    alone = _result(_tiny_engine(tiny), prompt, params)
    # Room for a few sequences only: they are admitted short, and their growth preempts and
    # recomputes some of them.
    tight = _tiny_engine(tiny, kv_cache_memory_bytes=None, num_gpu_blocks_override=36,
                         max_model_len=64)  # fmt: skip
    others = [_prompt(10, salt=i + 1) for i in range(7)]
    assert _result(tight, prompt, params, others) == alone
    assert tight.llm_engine.stats().num_preemptions > 0


def test_a_second_turn_reads_the_first_turns_output_alike(tiny):
    """A chat's next turn: the first turn's output cached (computed as decode rows) or
    recomputed as prompt, the second turn's tokens are the same."""
    first = _prompt(20)
    cached = _tiny_engine(tiny, enable_prefix_caching=True)
    reply, _ = _result(cached, first, GREEDY)
    second = first + list(reply) + _prompt(6, salt=3)
    with_cache = _result(cached, second, GREEDY)
    assert cached.llm_engine.prefix_cache_stats().hit_tokens >= 28
    assert with_cache == _result(_tiny_engine(tiny), second, GREEDY)


def test_every_step_runs_the_native_step(tiny, monkeypatch):
    llm = _tiny_engine(tiny, max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    steps = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda *a, **k: steps.append(1) or execute(*a, **k))
    _result(llm, _prompt(70), GREEDY, [_prompt(9, salt=1)])
    # Chunks of 32, mixed steps of a chunk and a decode, then decodes: every one native.
    assert len(steps) > GREEDY.max_tokens
    assert runner.native_steps == len(steps)


@pytest.mark.slow
def test_default_model_is_batch_invariant(default_source):
    """The GGUF default model at its own precision, beside others and from the cache."""

    def engine(**kwargs) -> LLM:
        return LLM(model=str(default_source.path), max_model_len=512,
                   kv_cache_memory_bytes=32 * 2**20, **kwargs)  # fmt: skip

    llm = engine(enable_prefix_caching=True)
    prompt = llm.get_tokenizer().encode("Write a short story about a forklift in a harbour.")
    prompt = prompt + prompt[1:] + prompt[1:]  # long enough for two cached blocks
    alone = _result(engine(), prompt, GREEDY)
    others = [llm.get_tokenizer().encode(f"Count to {i}.") for i in range(7)]
    assert _result(llm, prompt, GREEDY, others) == alone
    assert _result(llm, prompt, GREEDY) == alone  # now from the cache
    assert llm.llm_engine.prefix_cache_stats().hit_tokens >= 32
    chunked = engine(max_num_batched_tokens=16, max_num_seqs=16)
    assert _result(chunked, prompt, SEEDED) == _result(engine(), prompt, SEEDED)


def test_batch_invariant_off_keeps_dense_copies_for_prefill(tiny):
    """The opt-out: prefill chunks and large steps on the PyTorch layers' dense copies, the
    native step for small decode steps only."""
    if tiny.form != "int4":
        pytest.skip("block weights' dense copies only (dense: test_native_dense_step.py)")
    llm = _tiny_engine(tiny, batch_invariant=False)
    runner = llm.llm_engine.runner
    assert not runner.one_forward and runner.native_step_max_rows == 32
    assert not runner.model.layers[0].mlp.down_proj.weight.is_meta
    assert runner.quantization_report.dense_bytes > 0
    tokens, _ = _result(llm, _prompt(40), GREEDY)
    assert len(tokens) == GREEDY.max_tokens
    assert 0 < runner.native_steps < GREEDY.max_tokens  # the decodes, not the prompt
    one = _tiny_engine(tiny).llm_engine.runner
    assert one.one_forward and one.weight_bytes < runner.weight_bytes


def test_the_default_models_weights_are_its_file(default_source):
    """No dense copies and no dense embedding (the tied head holds the file's Q8_0 embedding
    blocks): what the memory plan counts is within 1.15x the file. An update of the
    embedding brings it back dense, and the step follows it."""
    llm = LLM(model=str(default_source.path), max_model_len=256,
              kv_cache_memory_bytes=16 * 2**20)  # fmt: skip
    runner = llm.llm_engine.runner
    assert runner.model.embed_tokens.weight.is_meta
    assert runner.weight_bytes <= 1.15 * default_source.path.stat().st_size
    prompt = llm.get_tokenizer().encode("One, two, three,")
    before = _result(llm, prompt, GREEDY)
    embedding = runner.model.quantized_head.dequantize()
    llm.update_weights([("model.embed_tokens.weight", -embedding)])
    assert not runner.model.embed_tokens.weight.is_meta
    assert _result(llm, prompt, GREEDY) != before


def test_prompt_logprobs_do_not_depend_on_chunks_or_neighbours(tiny):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    prompt = _prompt(50)

    def scores(llm: LLM, *others: list[int]):
        requests = [{"prompt_token_ids": p} for p in (prompt, *others)]
        out = llm.generate(requests, params, use_tqdm=False)[0]
        return [None if s is None else {t: lp.logprob for t, lp in s.items()}
                for s in out.prompt_logprobs]  # fmt: skip

    alone = scores(_tiny_engine(tiny))
    assert len(alone) == len(prompt) and alone[1] is not None
    chunked = _tiny_engine(tiny, max_num_batched_tokens=16, max_num_seqs=16)
    assert scores(chunked, _prompt(9, salt=2)) == alone


@pytest.mark.slow
def test_a_long_prompt_past_one_attention_chunk(default_source):
    """More than 1024 positions: the tiled attention kernel (bf16 caches on AVX-512) merges
    per-chunk partial sums; chunked prefill and the cache change nothing."""

    def engine(**kwargs) -> LLM:
        return LLM(model=str(default_source.path), max_model_len=2048,
                   kv_cache_memory_bytes=96 * 2**20, **kwargs)  # fmt: skip

    prompt = [3 + (37 * i) % 40000 for i in range(1100)]
    alone = _result(engine(enable_prefix_caching=False), prompt, GREEDY)
    chunked = engine(max_num_batched_tokens=384, enable_prefix_caching=True)
    assert _result(chunked, prompt, GREEDY, [prompt[:700] + [5, 6, 7]]) == alone
    assert _result(chunked, prompt, GREEDY) == alone  # from the cache
