"""Structured outputs in the engine: a tiny random model that never writes JSON by itself
writes JSON that validates, alone, in batches, with n > 1, under preemption and caching."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tiny_models import make_tiny_byte_level_model

from forklift import LLM, SamplingParams, StructuredOutputsParams
from forklift.sampling.sampler import apply_token_bitmask
from forklift.structured.grammar import GrammarCompiler
from forklift.tokenizer import Tokenizer

# Bounded everywhere (lengths, item counts, ranges), so a random model finishes in budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me about", "A person:", "Once upon a time", "JSON please", "x", "Hello there"]
# One block per 16 tokens: 2 layers x 1 KV head x head_dim 16 x fp32, K and V.
BLOCK_BYTES = 2 * 2 * 1 * 16 * 16 * 4


@pytest.fixture(scope="module")
def tokenizer(default_source) -> Tokenizer:
    return Tokenizer.from_gguf(default_source.gguf_reader())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny-byte-level")
    make_tiny_byte_level_model(directory, tokenizer)
    return directory


def make_llm(path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=400 * BLOCK_BYTES,
        enforce_eager=True,
    )
    kwargs.update(overrides)
    return LLM(model=str(path), **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


def schema_params(**overrides) -> SamplingParams:
    values = dict(
        temperature=1.0,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    values.update(overrides)
    return SamplingParams(**values)


def assert_valid_people(outputs) -> None:
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), PERSON)


def test_a_random_model_writes_no_json_unconstrained(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=40))
    for output in out:
        with pytest.raises(json.JSONDecodeError):
            json.loads(output.outputs[0].text)


def test_schema_outputs_validate_alone_and_in_a_batch(llm):
    params = [schema_params(seed=i) for i in range(len(PROMPTS))]
    batch = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_valid_people(batch)
    alone = llm.generate(PROMPTS[2], params[2], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == batch[2].outputs[0].token_ids
    greedy = llm.generate(PROMPTS, schema_params(temperature=0), use_tqdm=False)
    assert_valid_people(greedy)


def test_every_one_of_n_samples_follows_its_own_matcher(llm):
    out = llm.generate(PROMPTS[:2], schema_params(n=4, seed=11), use_tqdm=False)
    assert_valid_people(out)
    texts = {c.text for o in out for c in o.outputs}
    assert len(texts) == 8  # independent samples, each constrained


def test_unconstrained_greedy_rows_are_unchanged_beside_constrained_ones(llm):
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed_params = [plain if i % 2 == 0 else schema_params(seed=i) for i in range(len(PROMPTS))]
    mixed = llm.generate(PROMPTS, mixed_params, use_tqdm=False)
    for i in range(0, len(PROMPTS), 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    assert_valid_people([mixed[i] for i in range(1, len(PROMPTS), 2)])


def test_choice_regex_and_grammar(llm):
    choices = ["red", "green", "blue sky"]
    out = llm.generate(
        PROMPTS,
        [
            SamplingParams(
                seed=i, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices)
            )
            for i in range(len(PROMPTS))
        ],
        use_tqdm=False,
    )
    assert all(o.outputs[0].text in choices for o in out)
    pattern = r"[a-z]{3,8}@(example|test)\.(com|org)"
    out = llm.generate(
        PROMPTS,
        SamplingParams(
            seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern)
        ),
        use_tqdm=False,
    )
    for o in out:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    out = llm.generate(
        PROMPTS,
        SamplingParams(
            seed=6, max_tokens=60, structured_outputs=StructuredOutputsParams(grammar=gbnf)
        ),
        use_tqdm=False,
    )
    for o in out:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.outputs[0].text)


def test_preemption_recomputes_without_replaying_the_grammar(llm, tiny_dir):
    params = [schema_params(seed=i) for i in range(len(PROMPTS))]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    # 16 usable blocks = 256 tokens: six requests of ~100 tokens each cannot all stay.
    small = make_llm(tiny_dir, kv_cache_memory_bytes=17 * BLOCK_BYTES, max_model_len=256)
    got = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert_valid_people(got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_prefix_cache_hits_leave_the_grammar_alone(llm):
    prompt = "A long shared system prompt that fills more than one block of sixteen tokens. " * 2
    first = llm.generate(prompt, schema_params(seed=1), use_tqdm=False)
    second = llm.generate(prompt, schema_params(seed=1), use_tqdm=False)
    assert second[0].num_cached_tokens > 0
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert_valid_people(second)


def test_sampling_never_leaves_the_grammar(llm):
    # 400 samples of a choice at temperature 1: every one of them is a choice. (Before the
    # noise was kept below 1, about one draw in 300 picked a masked token.)
    choices = ["yes", "no"]
    params = SamplingParams(
        n=20, max_tokens=5, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outputs = llm.generate(
        [f"Pick {i}:" for i in range(20)],
        [params.clone(seed=i) for i in range(20)],
        use_tqdm=False,
    )
    assert {c.text for o in outputs for c in o.outputs} <= set(choices)


def test_a_grammar_outranks_bans_that_would_leave_no_token(llm, caplog):
    # The regex allows one token, which min_tokens (and the stop id) would ban; the grammar
    # wins instead of a masked row sampling garbage.
    only = llm.get_tokenizer().encode("a", add_special_tokens=False)
    params = SamplingParams(
        max_tokens=5,
        min_tokens=2,
        stop_token_ids=only,
        structured_outputs=StructuredOutputsParams(regex="a"),
    )
    (output,) = llm.generate("x", params, use_tqdm=False)
    assert output.outputs[0].text == "a" and output.outputs[0].finish_reason == "stop"
    assert "breaks its grammar" not in caplog.text


def test_streamed_deltas_add_up_to_valid_json(llm):
    engine = llm.llm_engine
    engine.add_request("stream", "Stream it:", schema_params(seed=4))
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(output.outputs[0].text)
    assert len(seen) > 5 and all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
    jsonschema.validate(json.loads(seen[-1]), PERSON)


def test_schemas_compile_once(llm):
    compiler = llm.llm_engine.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    before = compiler.num_cached
    for order in (schema, dict(reversed(list(schema.items())))):
        constraint = StructuredOutputsParams(json=order)
        llm.generate("x", SamplingParams(max_tokens=5, structured_outputs=constraint))
    assert compiler.num_cached == before + 1


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(json={"type": "strin"}), "does not compile"),
        (dict(json='{"type": '), "not valid JSON"),
        (dict(regex="(abc"), "does not compile"),
        (dict(regex=r"[^\s\S]"), "can match nothing"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable"),
        (dict(grammar='root ::= "a" undefined_rule'), "invalid grammar"),
    ],
)
def test_bad_constraints_are_a_value_error_naming_the_field(llm, options, field):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**options))
    with pytest.raises(ValueError, match=f"structured_outputs: .*{field}"):
        llm.generate("x", params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_option():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice must be"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice must be"):
        StructuredOutputsParams(choice="yes")  # a string is not a list of choices
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})


def test_a_word_level_tokenizer_is_refused_clearly(tmp_path):
    from tiny_models import word_level_tokenizer

    backend = word_level_tokenizer(16)
    compiler = GrammarCompiler(Tokenizer(backend, _special_tokens()), 16)
    with pytest.raises(ValueError, match="cannot be constrained|does not compile"):
        compiler.compile(StructuredOutputsParams(regex="w1 w2"))


def _special_tokens():
    from forklift.tokenizer import SpecialTokens

    return SpecialTokens(eos_token="w2")


def test_bitmask_keeps_exactly_the_allowed_tokens():
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = {0: [0, 31, 32, 69], 2: [5, 63, 64]}
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for out_row, row in enumerate(allowed):
        for token in allowed[row]:
            word, bit = divmod(token, 32)
            value = bitmask[out_row, word].item() | (1 << bit)
            bitmask[out_row, word] = value - (1 << 32) if value >= 1 << 31 else value
    masked = apply_token_bitmask(logits, torch.tensor(list(allowed)), bitmask)
    for row, tokens in allowed.items():
        kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert kept == tokens
        assert torch.equal(masked[row, tokens], logits[row, tokens])
    assert torch.equal(masked[1], logits[1])


def test_json_object_on_the_default_model(default_llm_fp32):
    question = "Give me a JSON object with the keys name and age for a cat named Tom who is 3."
    conversation = [{"role": "user", "content": question}]
    plain = default_llm_fp32.chat(
        [conversation], SamplingParams(temperature=0, max_tokens=80), use_tqdm=False
    )
    with pytest.raises(json.JSONDecodeError):  # the model wraps its JSON in prose
        json.loads(plain[0].outputs[0].text)
    constrained = default_llm_fp32.chat(
        [conversation],
        SamplingParams(
            temperature=0,
            max_tokens=80,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        use_tqdm=False,
    )
    completion = constrained[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert isinstance(json.loads(completion.text), dict), completion.text
