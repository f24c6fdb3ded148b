"""Captured decode: bucket choice, padding, replay bookkeeping, and eager == captured tokens."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import VOCAB, make_tiny_model

from forklift import LLM, SamplingParams
from forklift.config import EngineConfig
from forklift.model.layers.attention import AttentionGroup, AttentionMetadata
from forklift.runner.decode_capture import (
    MIN_KV_WIDTH,
    CaptureKey,
    DecodeCapture,
    StaticDecodeInputs,
    batch_bucket,
    capture_sizes,
    kv_width_bucket,
)


def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(10) == (1, 2, 4, 8, 10)
    assert capture_sizes(256)[-1] == 256
    assert capture_sizes(1) == (1,)
    assert capture_sizes(64, (8, 1, 4, 4)) == (1, 4, 8)


def test_bucket_choice():
    sizes = (1, 2, 4, 8)
    assert [batch_bucket(sizes, n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert batch_bucket(sizes, 9) is None
    assert kv_width_bucket(1, 2048) == MIN_KV_WIDTH
    assert kv_width_bucket(65, 2048) == 128
    assert kv_width_bucket(1000, 2048) == 1024
    assert kv_width_bucket(1500, 1600) == 1600  # capped at the model's length
    for context in (1, 63, 64, 65, 300, 1599):
        assert kv_width_bucket(context, 1600) >= context


@pytest.mark.parametrize(
    "field, value",
    [("enforce_eager", "yes"), ("decode_capture_sizes", (4, 0)), ("decode_capture_sizes", ())],
)
def test_bad_capture_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def _decode_inputs(batch: int, width: int, fill: int) -> tuple[torch.Tensor, ...]:
    ids = torch.full((batch,), fill)
    positions = torch.arange(batch) + fill
    group = AttentionGroup(
        query_index=torch.arange(batch)[:, None],
        padded_index=torch.arange(batch),
        token_index=torch.arange(batch),
        kv_blocks=torch.full((batch, width), fill),
        mask=torch.ones(batch, 1, 1, width, dtype=torch.bool),
    )
    return ids, positions, AttentionMetadata(torch.arange(batch) * fill, [group])


class RecordingBackend:
    """Stands in for CUDA graphs: 'replay' reruns the recorded callable on the static
    buffers, which is exactly what a graph does with its captured kernels."""

    name = "recording"

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, run):
        self.captured += 1
        return run


def test_capture_once_per_shape_then_replay_with_fresh_inputs():
    seen: list[StaticDecodeInputs] = []

    def forward(static: StaticDecodeInputs) -> torch.Tensor:
        seen.append(static)
        kv = static.meta.groups[0].kv_blocks.float().sum(1)
        return static.input_ids.float() + static.positions + kv

    backend = RecordingBackend()
    capture = DecodeCapture(backend, forward, (1, 2, 4), max_model_len=512)
    key = capture.key_for(3, max_context=70)
    assert key == CaptureKey(batch=4, kv_width=128)
    assert capture.key_for(5, 10) is None

    first = capture.run(key, *_decode_inputs(4, 128, fill=1))
    second = capture.run(key, *_decode_inputs(4, 128, fill=2))
    assert backend.captured == 1 and capture.stats.captures == 1
    assert capture.stats.replays == 2
    # The second replay read the second step's inputs through the same static buffers.
    assert seen[-1] is seen[0]
    assert first.tolist() == [1 + p + 128 for p in range(1, 5)]
    assert second.tolist() == [2 + p + 256 for p in range(2, 6)]

    capture.run(CaptureKey(2, 64), *_decode_inputs(2, 64, fill=1))
    assert capture.captured_keys == [key, CaptureKey(2, 64)]
    capture.reset()
    assert capture.captured_keys == []
    capture.run(key, *_decode_inputs(4, 128, fill=1))
    assert backend.captured == 3


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _chosen_logprobs(completion) -> list[float]:
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    return [step[token].logprob for step, token in pairs]


def _tiny_llm(path, enforce_eager: bool) -> LLM:
    return LLM(
        model=str(path),
        dtype="float32",
        max_model_len=256,
        block_size=4,
        kv_cache_memory_bytes=2**20,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
    )


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_captured_decode_gives_the_eager_tokens(arch, tmp_path):
    """fp32 greedy: 5 sequences pad to the bucket of 8; as some finish early the batch
    shrinks through the buckets of 4, 2 and 1. Mistral's sliding window masks padded keys."""
    make_tiny_model(arch, tmp_path)
    prompts = _prompts(7, (3, 9, 17, 30, 5))
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
        for n in (40, 12, 25, 6, 33)
    ]
    eager = _tiny_llm(tmp_path, enforce_eager=True)
    captured = _tiny_llm(tmp_path, enforce_eager=False)
    assert eager.llm_engine.runner.decode_capture is None
    expected = eager.generate(prompts, params, use_tqdm=False)
    got = captured.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        want_lp = _chosen_logprobs(want.outputs[0])
        have_lp = _chosen_logprobs(have.outputs[0])
        assert have_lp == pytest.approx(want_lp, abs=1e-4)
    capture = captured.llm_engine.runner.decode_capture
    assert {k.batch for k in capture.captured_keys} >= {8, 4, 2, 1}
    assert capture.stats.replays > 30
    engine = captured.llm_engine
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_captures_are_redone_after_the_kv_cache_is_reallocated(tmp_path):
    make_tiny_model("llama", tmp_path)
    llm = _tiny_llm(tmp_path, enforce_eager=False)
    prompts = _prompts(3, (6, 11))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    capture = llm.llm_engine.runner.decode_capture
    assert capture.captured_keys
    llm.sleep(level=2)
    assert capture.captured_keys == []
    llm.wake_up()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
    assert capture.captured_keys


def test_padded_rows_decode_in_the_null_block_and_sample_nothing(tmp_path):
    make_tiny_model("llama", tmp_path)
    llm = _tiny_llm(tmp_path, enforce_eager=False)
    engine = llm.llm_engine
    engine.add_request(None, [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # prefill
    scheduled = engine.scheduler.schedule().scheduled
    inputs = engine.runner.input_builder.prepare(scheduled, pad_to=4, kv_width=64)
    assert inputs.input_ids.tolist()[1:] == [0, 0, 0]
    assert inputs.positions.tolist() == [5, 0, 0, 0]
    assert inputs.meta.slot_mapping.tolist()[1:] == [0, 0, 0]
    assert inputs.sample_index.tolist() == [0]
    group = inputs.meta.groups[0]
    # Whole blocks: 64 key positions in blocks of block_size; padded rows read the null block.
    width = 64 // engine.config.block_size
    assert group.kv_blocks.shape == (4, width)
    assert group.kv_blocks[1:].tolist() == [[0] * width] * 3
    # Decode masks are float biases: 0 where a query attends, -inf elsewhere. A padded row
    # attends to exactly the null block's first slot (finite, never NaN).
    attends = group.mask == 0
    assert (attends | (group.mask == float("-inf"))).all()
    assert attends[1:, 0, 0].sum(-1).tolist() == [1, 1, 1]
    assert attends[0, 0, 0].sum().item() == 6
