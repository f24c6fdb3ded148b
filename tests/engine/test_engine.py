"""Engine behaviour on a tiny random Llama: paging, chunking, seeds, n, stops, aborts, errors."""

from __future__ import annotations

import random

import pytest
from tiny_models import VOCAB, make_tiny_model

from forklift import LLM, LLMEngine, SamplingParams

# 2 layers x 2 KV heads x head_dim 16 x fp32, K and V, 4-token blocks.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", directory)
    return directory


def make_llm(path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        max_model_len=128,
        block_size=4,
        kv_cache_memory_bytes=400 * BLOCK_BYTES,
        max_num_batched_tokens=128,
    )
    kwargs.update(overrides)
    return LLM(model=str(path), **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


def random_prompts(count: int, seed: int, low: int = 5, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_paging_under_pressure_gives_the_same_outputs(llm, tiny_dir):
    prompts = random_prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))

    # 33 usable blocks = 132 tokens: one max_model_len request fits, eight at once do not.
    small = make_llm(tiny_dir, kv_cache_memory_bytes=34 * BLOCK_BYTES)
    engine = small.llm_engine
    assert engine.num_usable_blocks == 33
    got = token_ids(small.generate(prompts, params, use_tqdm=False))
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_sampled_outputs_survive_preemption(llm, tiny_dir):
    prompts = random_prompts(8, seed=2)
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True) for i in range(8)
    ]
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    small = make_llm(tiny_dir, kv_cache_memory_bytes=34 * BLOCK_BYTES)
    assert token_ids(small.generate(prompts, params, use_tqdm=False)) == expected
    assert small.llm_engine.scheduler.num_preemptions > 0


def test_chunked_prefill_matches_unchunked(llm, tiny_dir):
    prompt = random_prompts(1, seed=3, low=100, high=100)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    whole = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    chunked_llm = make_llm(tiny_dir, max_num_batched_tokens=16)
    engine = chunked_llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": prompt[0]}, params)
    steps_before_first_token = 0
    while not engine.step():
        steps_before_first_token += 1
    # 100 prompt tokens at 16 per step: six chunks that do not sample, the seventh does.
    assert steps_before_first_token == 6
    while engine.has_unfinished_requests():
        engine.step()
    again = chunked_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == whole.token_ids
    assert [lp[t].logprob for lp, t in zip(again.logprobs, again.token_ids, strict=True)] == (
        pytest.approx(
            [lp[t].logprob for lp, t in zip(whole.logprobs, whole.token_ids, strict=True)], abs=1e-4
        )
    )


def test_same_seed_same_text_alone_and_in_a_batch(llm):
    prompt = "w10 w20 w30 w40"
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    others = [f"w{i} w{i + 7} w{i + 3}" for i in range(3, 19)]
    other_params = [
        SamplingParams(temperature=0.7 if i % 2 else 0, max_tokens=10 + i, ignore_eos=True)
        for i in range(16)
    ]
    batch = llm.generate(
        others[:8] + [prompt] + others[8:],
        other_params[:8] + [params] + other_params[8:],
        use_tqdm=False,
    )
    in_batch = batch[8].outputs[0]
    assert len(batch) == 17
    assert in_batch.text == alone.text
    assert in_batch.token_ids == alone.token_ids
    different = llm.generate(prompt, params.clone(seed=4321), use_tqdm=False)[0].outputs[0]
    assert different.token_ids != alone.token_ids


def test_n_samples_are_distinct_and_indexed(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    output = llm.generate("w5 w6 w7", params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    single = llm.generate("w5 w6 w7", params.clone(n=1), use_tqdm=False)[0].outputs[0]
    assert single.token_ids == output.outputs[0].token_ids
    greedy = llm.generate(
        "w5 w6 w7", SamplingParams(n=3, temperature=0, max_tokens=8), use_tqdm=False
    )
    assert len({tuple(c.token_ids) for c in greedy[0].outputs}) == 1


def test_stop_string_straddling_tokens(llm):
    base = llm.generate(
        "w9 w8", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert base[0].prompt == "w9 w8"  # text prompts keep their text in the output
    words = base[0].outputs[0].text.split(" ")
    assert len(words) >= 6
    # The stop string begins inside the 4th word's token and ends inside the 5th's.
    stop = words[3][1:] + " " + words[4][:2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = llm.generate("w9 w8", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == " ".join(words[:3]) + " " + words[3][:1]
    kept = llm.generate("w9 w8", params.clone(include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == out.text + stop


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(
        "w3 w4", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    tokens = base[0].outputs[0].token_ids
    stop_token = tokens[2]
    out = llm.generate(
        "w3 w4",
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids[-1] == stop_token
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token
    held = llm.generate(
        "w3 w4",
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop_token not in held.token_ids[:6]


def test_max_tokens_is_capped_by_max_model_len(llm):
    prompt = random_prompts(1, seed=5, low=120, high=120)[0]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 128 - 120
    assert out[0].outputs[0].finish_reason == "length"


def test_streaming_engine_and_abort_frees_blocks(llm):
    engine: LLMEngine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("keep", "w11 w12 w13", params)
    engine.add_request("drop", "w21 w22 w23", params)
    seen: dict[str, int] = {}
    for _ in range(5):
        for output in engine.step():
            seen[output.request_id] = len(output.outputs[0].token_ids)
    assert seen == {"keep": 5, "drop": 5}
    aborted = engine.abort_request("drop")
    assert aborted[0].outputs[0].finish_reason == "abort"
    assert engine.get_num_unfinished_requests() == 1
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "keep"
            final = output
    assert final is not None and final.finished
    assert len(final.outputs[0].token_ids) == 30
    assert final.metrics.first_token_time <= final.metrics.finished_time
    assert final.metrics.arrival_time <= final.metrics.first_token_time
    assert engine.num_free_blocks == engine.num_usable_blocks


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([5] * 200, SamplingParams(), "max_model_len"),
        ([5, VOCAB + 3], SamplingParams(), "vocabulary"),
        (12, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm, prompt, params, message):
    engine = llm.llm_engine
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate("w40 w41", good, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", "w40 w41", good)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt] if isinstance(prompt, list) else prompt, params, use_tqdm=False)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final.request_id == "good"
    assert final.outputs[0].token_ids == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),  # the upper bound is EngineConfig.max_logprobs
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"top_k": 2**70}, "top_k"),  # would overflow an int64 tensor on the engine thread
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.llm_engine
    engine.add_request("dup", "w1 w2", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "w1 w2", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_request_id_may_not_clash_with_another_requests_sample_ids(llm):
    # Samples of "x" are "x#0" and "x#1": a request named "x#1" would share a sequence id.
    engine = llm.llm_engine
    engine.add_request("x", "w1 w2", SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x#1", "w1 w2", SamplingParams(max_tokens=2))
    engine.add_request("y#0", "w1 w2", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", "w1 w2", SamplingParams(n=2, max_tokens=2))
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"x", "y#0"}


def test_an_engine_chosen_id_skips_one_whose_sample_ids_are_taken(llm):
    engine = llm.llm_engine
    probe = engine.add_request(None, "w1 w2", SamplingParams(max_tokens=2))
    upcoming = str(int(probe) + 1)  # the id the engine would choose next: ids count up
    engine.add_request(f"{upcoming}#1", "w1 w2", SamplingParams(max_tokens=2))
    chosen = engine.add_request(None, "w1 w2", SamplingParams(n=2, max_tokens=2))
    assert chosen != upcoming
    while engine.has_unfinished_requests():
        engine.step()


def test_unknown_engine_argument_is_an_error(tiny_dir):
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_sequences"):
        LLM(model=str(tiny_dir), max_num_sequences=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"dtype": "int3"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
    ],
)
def test_bad_engine_config_names_the_field(tiny_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tiny_dir), **kwargs)


def test_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))


def test_truncated_gguf_is_rejected(tmp_path, default_source):
    truncated = tmp_path / "cut.gguf"
    with open(default_source.path, "rb") as f:
        truncated.write_bytes(f.read(3 * 2**20))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LLM(model=str(truncated))


def test_refuses_to_start_when_one_request_cannot_fit(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len=128 needs 32 blocks"):
        make_llm(tiny_dir, kv_cache_memory_bytes=20 * BLOCK_BYTES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_count_means_the_same_cache_in_any_dtype(tiny_dir, dtype):
    """num_gpu_blocks_override (vLLM's name) fixes the blocks, not the bytes, so a budget
    sized for one dtype does not halve in another; it wins over a byte budget too."""
    llm = make_llm(tiny_dir, dtype=dtype, num_gpu_blocks_override=40,
                   kv_cache_memory_bytes=4 * BLOCK_BYTES)  # fmt: skip
    plan = llm.llm_engine.kv_plan
    assert plan.num_blocks == 40 and plan.token_capacity == 39 * 4
    assert plan.budget_bytes == 40 * plan.bytes_per_block
    assert plan.source == "num_gpu_blocks_override=40"
    assert llm.llm_engine.kv_manager.pool.num_blocks == 40
    with pytest.raises(ValueError, match="max_model_len=128 needs 32 blocks"):
        make_llm(tiny_dir, dtype=dtype, num_gpu_blocks_override=20)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        make_llm(tiny_dir, num_gpu_blocks_override=0)


def test_kv_budget_from_memory_fraction(tiny_dir, caplog):
    caplog.set_level("INFO", logger="forklift")
    llm = make_llm(tiny_dir, kv_cache_memory_bytes=None, gpu_memory_utilization=0.01)
    plan = llm.llm_engine.kv_plan
    assert plan.num_blocks > 1000
    assert "activation peak" in plan.source
    assert any("max concurrency" in r.getMessage() for r in caplog.records)


def test_stop_strings_wait_for_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    words = llm.generate("w9 w8", greedy, use_tqdm=False)[0].outputs[0].text.split(" ")
    stop = words[1]
    early = llm.generate("w9 w8", greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 2
    held = llm.generate("w9 w8", greedy.clone(stop=[stop], min_tokens=4), use_tqdm=False)
    held_text = held[0].outputs[0].text
    # The word at token 2 is kept; only an occurrence after the 4th token could stop it.
    assert held_text.split(" ")[:2] == words[:2]
    assert len(held[0].outputs[0].token_ids) >= 4


def test_finished_only_steps_return_just_the_final_outputs(llm):
    """`step(finished_only=True)` (what `LLM.generate` runs) builds an output only for the
    requests that finished in it, and those equal the outputs an ordinary step returns."""
    engine = llm.llm_engine
    prompts = random_prompts(3, seed=7)
    lengths = (3, 9, 17)  # three requests finishing at three different steps
    outputs: dict[str, dict[bool, object]] = {}
    for finished_only in (False, True):
        ids = [
            engine.add_request(
                None,
                {"prompt_token_ids": p},
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1),
            )
            for p, n in zip(prompts, lengths, strict=True)
        ]
        while engine.has_unfinished_requests():
            for output in engine.step(finished_only=finished_only):
                if finished_only:
                    assert output.finished
                if output.finished:
                    index = ids.index(output.request_id)
                    outputs.setdefault(str(index), {})[finished_only] = output
    assert len(outputs) == 3
    for pair in outputs.values():
        every, final = pair[False], pair[True]
        assert final.outputs[0].token_ids == every.outputs[0].token_ids
        assert final.outputs[0].text == every.outputs[0].text
        # The second run reads its prompts from the prefix cache: the same tokens, logprobs
        # within float rounding.
        for got, want in zip(final.outputs[0].logprobs, every.outputs[0].logprobs, strict=True):
            assert got.keys() == want.keys()
            for token, logprob in got.items():
                assert logprob.logprob == pytest.approx(want[token].logprob, abs=1e-4)
