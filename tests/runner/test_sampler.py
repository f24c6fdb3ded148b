"""The sampler on hand-made logits: filters, penalties, seeded noise, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from forklift.core.request import Request
from forklift.native import build as native_build
from forklift.native.seeded_sample import NativeSeededSampler
from forklift.sampling.metadata import SamplingBatch
from forklift.sampling.sampler import (
    apply_penalties,
    first_max_index,
    hashed_uniform,
    sample,
)
from forklift.sampling_params import SamplingParams


def batch_for(
    params: list[SamplingParams], outputs=None, prompts=None, seeds=None
) -> SamplingBatch:
    requests = []
    for i, p in enumerate(params):
        request = Request(
            request_id=str(i),
            prompt_token_ids=(prompts or [[0]] * len(params))[i],
            sampling_params=p,
            seed=(seeds or list(range(len(params))))[i],
            max_tokens=100,
            eos_token_ids=frozenset({0}),
        )
        for t in (outputs or [[]] * len(params))[i]:
            request.append_output_token(t)
        requests.append(request)
    return SamplingBatch.from_rows([r.sampling_row() for r in requests], torch.device("cpu"))


def test_hashed_noise_is_uniform_and_depends_only_on_seed_and_step():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    steps = torch.tensor([0, 0, 1], dtype=torch.int64)
    u = hashed_uniform(seeds, steps, 50_000)
    assert bool(((u > 0) & (u < 1)).all())
    assert u.mean().item() == pytest.approx(0.5, abs=0.01)
    assert u.std().item() == pytest.approx(math.sqrt(1 / 12), abs=0.01)
    # Rows differ by seed and by step, and a row is the same whatever shares its batch.
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    alone = hashed_uniform(seeds[:1], steps[:1], 50_000)
    assert torch.equal(alone[0], u[0])


ARCHES = [None, ("-march=x86-64-v3",), ("-march=x86-64",)]
SEEDS = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321, 42])
STEPS = torch.tensor([0, 5, 7, 2**40, 3, -2, 1, 100000])


def native_sampler(arch) -> NativeSeededSampler:  # noqa: ANN001
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    kernel = NativeSeededSampler.load(arch)
    assert kernel is not None
    return kernel


@pytest.mark.parametrize("arch", ARCHES)
def test_the_native_sampler_hashes_the_torch_expressions_noise(arch):
    """On flat logits the Gumbel-max draw is the token with the largest uniform: the C
    kernel (this CPU's build, AVX2's, plain x86-64's) makes the PyTorch expression's bits."""
    kernel = native_sampler(arch)
    for vocab in (1, 31, 3000):
        u = hashed_uniform(SEEDS, STEPS, vocab)
        flat = torch.zeros(len(SEEDS), vocab)
        drawn = kernel(flat, torch.ones(len(SEEDS)), SEEDS, STEPS, with_logprobs=True)
        assert torch.equal(drawn.token_ids, first_max_index(u))
        assert drawn.logprobs == pytest.approx([-math.log(vocab)] * len(SEEDS), abs=1e-5)
        assert torch.equal(drawn.ranks, torch.ones(len(SEEDS), dtype=torch.int64))


@pytest.mark.parametrize("arch", ARCHES)
def test_the_native_sampler_draws_what_the_torch_operators_draw(arch):
    """Greedy and tempered rows, -inf (masked) tokens, a vocabulary of odd size: the same
    tokens as log-of-log noise in float64 picks, logprobs and ranks as log_softmax's."""
    kernel = native_sampler(arch)
    generator = torch.Generator().manual_seed(3)
    rows, vocab = len(SEEDS), 49157
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[:, ::7] = float("-inf")
    temperature = torch.tensor([0.0, 1.0, 0.3, 2.0, 0.0, 0.7, 1.5, 1.0])
    drawn = kernel(logits, temperature, SEEDS, STEPS, with_logprobs=True)
    scaled = logits.double() / torch.where(temperature > 0, temperature, 1.0).double()[:, None]
    gumbel = -torch.log(-torch.log(hashed_uniform(SEEDS, STEPS, vocab).double()))
    drawn_rows = first_max_index(scaled + gumbel)
    expected = torch.where(temperature > 0, drawn_rows, first_max_index(logits))
    assert torch.equal(drawn.token_ids, expected)
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, expected[:, None])
    assert drawn.logprobs.double() == pytest.approx(chosen[:, 0], abs=2e-5)
    assert torch.equal(drawn.ranks, (logprobs > chosen).sum(dim=-1) + 1)
    tokens_only = kernel(logits, temperature, SEEDS, STEPS, with_logprobs=False)
    assert torch.equal(tokens_only.token_ids, expected) and tokens_only.logprobs is None


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    out = sample(logits, batch_for([SamplingParams(temperature=0)] * 2))
    assert out.token_ids == [1, 0]


def test_ties_go_to_the_first_maximum_as_argmax_does():
    """Greedy equality between paths rests on one tie rule: the first maximal index."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, -1.0, -2.0]])
    assert first_max_index(logits).tolist() == [1, 0, 0] == logits.argmax(dim=-1).tolist()
    out = sample(logits, batch_for([SamplingParams(temperature=0)] * 3))
    assert out.token_ids == [1, 0, 0]
    torch.manual_seed(3)
    wide = torch.randn(16, 49152).round(decimals=1)  # many ties
    assert torch.equal(first_max_index(wide), wide.argmax(dim=-1))


def test_narrow_filters_reduce_sampling_to_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ] * 2
    out = sample(logits, batch_for(params, seeds=[11, 12, 13, 14, 15, 16]))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_sampling_frequencies_follow_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    out = sample(logits, batch_for(params, seeds=list(range(4000))))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert counts.tolist() == pytest.approx(probs.tolist(), abs=0.03)


def test_top_k_and_top_p_keep_only_the_head():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(500, 1)
    top_k = sample(logits, batch_for([SamplingParams(temperature=5.0, top_k=2)] * 500))
    assert set(top_k.token_ids) == {0, 1}
    # softmax([4,3,2,1,0]) = [.64, .24, .09, ...]: top_p 0.8 keeps the first two.
    top_p = sample(logits, batch_for([SamplingParams(temperature=1.0, top_p=0.8)] * 500))
    assert set(top_p.token_ids) == {0, 1}


def test_temperature_flattens_the_distribution():
    logits = torch.tensor([[2.0, 0.0]]).repeat(3000, 1)
    cold = sample(logits, batch_for([SamplingParams(temperature=0.5)] * 3000))
    hot = sample(logits, batch_for([SamplingParams(temperature=4.0)] * 3000))
    p_cold = 1 - sum(cold.token_ids) / 3000
    p_hot = 1 - sum(hot.token_ids) / 3000
    assert p_cold == pytest.approx(1 / (1 + math.exp(-4)), abs=0.03)
    assert p_hot == pytest.approx(1 / (1 + math.exp(-0.5)), abs=0.03)


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    batch = batch_for([params], outputs=[[2, 2, 3]], prompts=[[1]])
    out = apply_penalties(logits, batch)
    expected = [
        2.0,  # never seen
        -1.0 * 2.0,  # in the prompt: negative logits are multiplied
        3.0 / 2.0 - 0.5 - 0.25 * 2,  # twice in the output
        0.5 / 2.0 - 0.5 - 0.25 * 1,  # once in the output
    ]
    assert out[0].tolist() == pytest.approx(expected)


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, batch_for([params])).token_ids == [1]
    # Once min_tokens outputs exist, EOS (id 0) may be chosen again.
    assert sample(logits, batch_for([params], outputs=[[1, 1]])).token_ids == [0]


def test_raw_logprobs_mode_reports_the_model_distribution_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0, logprobs=2, repetition_penalty=2.0, logprobs_mode="raw")
    out = sample(logits, batch_for([params], outputs=[[1]]))
    raw = torch.log_softmax(logits, dim=-1)[0]
    # The penalty (3 / 2 = 1.5) moves the choice to token 2, the raw distribution's second.
    assert out.token_ids == [2]
    assert out.logprobs[0] == pytest.approx(raw[2].item())
    assert out.ranks[0] == 2
    assert out.top_ids[0] == [1, 2]
    assert out.top_logprobs[0] == pytest.approx([raw[1].item(), raw[2].item()])


def test_processed_logprobs_are_those_of_the_distribution_sampled_from():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    # Greedy with a penalty on the prompt token 0 and the output token 1: the penalised
    # logits, where token 2 now ranks first.
    greedy = SamplingParams(temperature=0, logprobs=1, repetition_penalty=2.0)
    out = sample(logits, batch_for([greedy], outputs=[[1]]))
    penalised = torch.log_softmax(torch.tensor([0.5, 1.5, 2.5, 0.0]), dim=-1)
    assert out.token_ids == [2] and out.ranks == [1]
    assert out.logprobs[0] == pytest.approx(penalised[2].item())
    # Temperature and top-k: log_softmax(logits / T) renormalised over the kept tokens.
    hot = SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=1)
    out = sample(logits, batch_for([hot]))
    kept = torch.log_softmax(torch.tensor([3.0, 2.5]) / 0.5, dim=-1)
    assert out.token_ids[0] in (1, 2)
    assert out.logprobs[0] == pytest.approx(kept[out.token_ids[0] - 1].item())
    assert out.top_logprobs[0][:2] == pytest.approx(kept.tolist())
    assert out.top_logprobs[0][2] == float("-inf")


def test_noise_stays_below_one_so_gumbel_is_finite():
    # Seed 0, step 242, token 17196 hashes to the top 24-bit value, which a float32
    # (bits + 0.5) / 2**24 rounds to exactly 1.0: infinite noise that would pick any token,
    # even one masked to -inf.
    seeds, steps = torch.tensor([0]), torch.tensor([242])
    uniform = hashed_uniform(seeds, steps, 49152)
    assert float(uniform[0, 17196]) == 1.0 - 2.0**-24 and bool((uniform < 1).all())
    gumbel = -torch.log(-torch.log(uniform))
    assert bool(torch.isfinite(gumbel).all())
    if native_build.find_compiler() is not None:
        # The native draw: that token wins flat logits, and loses once it is masked.
        kernel = native_sampler(None)
        flat = torch.zeros(1, 49152)
        assert kernel(flat, torch.ones(1), seeds, steps, False).token_ids.tolist() == [17196]
        flat[0, 17196] = float("-inf")
        assert kernel(flat, torch.ones(1), seeds, steps, False).token_ids.tolist() != [17196]


def test_the_native_and_the_pytorch_paths_sample_alike(monkeypatch):
    """Every kind of row in one batch: the same tokens, logprobs and ranks whether the
    native kernel draws or PyTorch's operators do (where no compiler works)."""
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.8, logprobs=0),
        SamplingParams(temperature=1.2, top_k=50, logprobs=0),
        SamplingParams(temperature=0.9, top_p=0.8, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=1.0, logprobs=1, logprobs_mode="raw"),
        SamplingParams(temperature=0.0),
    ]
    generator = torch.Generator().manual_seed(5)
    for subset in (slice(0, 2), slice(0, 3), slice(0, 8), slice(4, 6)):
        chosen = params[subset]
        logits = torch.randn(len(chosen), 5000, generator=generator) * 3
        batch = batch_for(
            chosen, outputs=[[7, 9]] * len(chosen), seeds=[11, 12, 13, 14, 15, 16, 17, 18][subset]
        )
        native = sample(logits, batch)
        monkeypatch.setattr("forklift.sampling.sampler.native_seeded_sampler", lambda: None)
        reference = sample(logits, batch)
        monkeypatch.undo()
        assert native.token_ids == reference.token_ids
        if reference.logprobs is None:
            assert native.logprobs is None
        else:
            assert native.logprobs == pytest.approx(reference.logprobs, abs=2e-5)
        if reference.top_logprobs is not None:
            flat = [value for row in native.top_logprobs for value in row]
            expected = [value for row in reference.top_logprobs for value in row]
            assert flat == pytest.approx(expected, abs=2e-5)
        assert native.ranks == reference.ranks and native.top_ids == reference.top_ids
