"""logit_bias, allowed_token_ids and bad_words: each changes exactly the rows that ask for it,
greedy and sampled, and bad values are a ValueError naming the field."""

from __future__ import annotations

import pytest

from forklift import SamplingParams
from forklift.structured.params import StructuredOutputsParams

PROMPTS = ["The capital of France is", "One, two, three,"]


def _tokens(llm, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def test_logit_bias_forces_and_bans_greedy_tokens_beside_unbiased_rows(default_llm_fp32):
    llm = default_llm_fp32
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    baseline = _tokens(llm, PROMPTS, greedy)
    first = baseline[0][0][0]
    forced = 1000 if first != 1000 else 1001
    rows = _tokens(
        llm,
        [PROMPTS[0], PROMPTS[0], PROMPTS[1]],
        [
            greedy.clone(logit_bias={forced: 100}),
            greedy.clone(logit_bias={first: -100}),
            greedy,
        ],
    )
    assert rows[0][0] == [forced] * 6
    assert rows[1][0][0] != first
    assert rows[2] == baseline[1]  # the unbiased row, token for token


def test_logit_bias_under_sampling_and_in_processed_logprobs(default_llm_fp32):
    llm = default_llm_fp32
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4, seed=3)
    plain = _tokens(llm, [PROMPTS[1]], sampled)[0]
    banned = sorted({t for sample in plain for t in sample})[:5]
    rows = llm.generate(
        [PROMPTS[1], PROMPTS[1], PROMPTS[1]],
        [
            sampled.clone(logit_bias={42: 100}, logprobs=1),
            sampled.clone(logit_bias=dict.fromkeys(banned, -100)),
            sampled,
        ],
        use_tqdm=False,
    )
    forced = rows[0].outputs
    assert all(list(c.token_ids) == [42] * 8 for c in forced)
    # `processed` logprobs are those of the biased distribution: the forced token is certain.
    assert all(c.logprobs[i][42].logprob > -1e-3 for c in forced for i in range(8))
    assert not {t for c in rows[1].outputs for t in c.token_ids} & set(banned)
    assert [list(c.token_ids) for c in rows[2].outputs] == plain


def test_allowed_token_ids_limit_every_sample(default_llm_fp32):
    allowed = [11, 28, 253, 1012, 4302]
    for temperature in (0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, n=2,
                                seed=0, allowed_token_ids=allowed)  # fmt: skip
        samples = _tokens(default_llm_fp32, PROMPTS, params)
        produced = {t for row in samples for sample in row for t in sample}
        assert produced and produced <= set(allowed)


def test_allowed_token_ids_win_over_min_tokens_bans(default_llm_fp32):
    """Only EOS allowed while min_tokens bans it: the allowed token is still what comes out
    (a row with nothing left would otherwise fall to token 0)."""
    eos = min(default_llm_fp32.get_tokenizer().eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, ignore_eos=True,
                            allowed_token_ids=[eos])  # fmt: skip
    out = default_llm_fp32.generate("Hi", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids and set(out.token_ids) == {eos}


def test_bad_words_are_never_completed(default_llm_fp32):
    llm = default_llm_fp32
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text
    word = next(w.strip(".,") for w in text.split() if len(w.strip(".,")) > 3)
    banned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])
    output = llm.generate(PROMPTS[0], banned, use_tqdm=False)[0].outputs[0]
    assert word not in output.text
    ids = list(output.token_ids)
    for variant in (word, " " + word):
        seq = tokenizer.encode(variant, add_special_tokens=False)
        windows = [ids[i : i + len(seq)] for i in range(len(ids) - len(seq) + 1)]
        assert seq not in windows


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"allowed_token_ids": list(range(60_000))}, "allowed_token_ids"),
        (
            {"allowed_token_ids": [5], "structured_outputs": StructuredOutputsParams(regex="a")},
            "allowed_token_ids",
        ),
    ],
)
def test_bad_token_choices_name_the_field(default_llm_fp32, fields, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        default_llm_fp32.generate("Hi", SamplingParams(max_tokens=2, **fields), use_tqdm=False)
