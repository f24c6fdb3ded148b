"""Reused sampling batches: every step's batch equals the one built from its rows, and the
settings' tensors are only built again when the rows or their settings change."""

from __future__ import annotations

import dataclasses

import torch

from forklift.core.scheduler_output import SamplingRow
from forklift.sampling.batch_reuse import SamplingBatchReuse
from forklift.sampling.metadata import SamplingBatch
from forklift.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 64


def _assert_same_batch(got: SamplingBatch, want: SamplingBatch) -> None:
    for field in dataclasses.fields(SamplingBatch):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


def _rows(params: list[SamplingParams], outputs: list[list[int]]) -> list[SamplingRow]:
    return [
        SamplingRow(p, seed=7 + i, prompt_token_ids=[3, 4, 5], output_token_ids=list(out),
                    eos_token_ids=frozenset({2}))
        for i, (p, out) in enumerate(zip(params, outputs, strict=True))
    ]  # fmt: skip


def test_a_decode_loop_reuses_the_settings_and_matches_a_fresh_batch():
    params = [
        SamplingParams(temperature=0.7, top_k=5, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=3),
    ]
    reuse = SamplingBatchReuse()
    outputs: list[list[int]] = [[], []]
    first = None
    for step in range(4):
        rows = _rows(params, outputs)
        got = reuse.batch_for(rows, CPU, VOCAB)
        _assert_same_batch(got, SamplingBatch.from_rows(rows, CPU, VOCAB))
        if first is None:
            first = got
        else:  # the settings' tensors are the first step's
            assert got.temperature is first.temperature and got.seeds is first.seeds
        assert got.steps.tolist() == [step, step]
        # min_tokens bans the stop ids and the EOS for the first two outputs only.
        assert sorted(got.banned_token_ids[0]) == ([2, 9] if step < 2 else [])
        for out in outputs:
            out.append(10 + step)


def test_changed_rows_or_settings_build_the_batch_again():
    a, b = SamplingParams(temperature=0.5), SamplingParams(temperature=0)
    reuse = SamplingBatchReuse()
    first = reuse.batch_for(_rows([a, b], [[], []]), CPU, VOCAB)
    for params in ([b, a], [a], [a, b, SamplingParams()], [a, SamplingParams(temperature=0)]):
        rows = _rows(params, [[1]] * len(params))
        got = reuse.batch_for(rows, CPU, VOCAB)
        assert got.temperature is not first.temperature
        _assert_same_batch(got, SamplingBatch.from_rows(rows, CPU, VOCAB))
    # Another seed for the same settings objects: built again too.
    reuse.batch_for(_rows([a, b], [[], []]), CPU, VOCAB)
    rows = _rows([a, b], [[], []])
    rows[0] = dataclasses.replace(rows[0], seed=99)
    assert reuse.batch_for(rows, CPU, VOCAB).seeds.tolist() == [99, 8]
