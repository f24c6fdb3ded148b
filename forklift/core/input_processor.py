"""Prompt and SamplingParams in, a checked request out: the one place a prompt is tokenized
and validated, for the offline API, the engine and the server alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forklift.config import EngineConfig
from forklift.core.request_limits import check_context_length, check_sampling_limits
from forklift.sampling_params import SamplingParams
from forklift.structured.grammar import GrammarCompiler
from forklift.tokenizer import Tokenizer

# Text, token ids, or a {"prompt" | "prompt_token_ids", optional "cache_salt"} dict.
PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt checked against its SamplingParams: the engine queues it without checking
    it again, so a caller may process off the engine's thread."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the prompt came as text (kept for outputs)
    cache_salt: str | None = None


class InputProcessor:
    """Tokenizes and validates prompts for one model. Read-only after construction, so safe
    to use from any thread (the grammar compiler guards its own cache)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None,
        grammars: GrammarCompiler,
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(
        self, prompt: PromptType, params: SamplingParams, *, strict_context: bool = False
    ) -> ProcessedPrompt:
        """Check `params`, then tokenize and check `prompt`; ValueError naming what is wrong.

        `strict_context` adds the server's rule (vLLM's): prompt plus max_tokens must fit in
        max_model_len, where the offline engine stops such a request at the limit."""
        self._check_params(params)
        text, ids = self._tokenize(prompt)
        self._check_prompt_ids(ids)
        salt = _cache_salt(prompt)
        if strict_context:
            check_context_length(len(ids), params.max_tokens, self.max_model_len)
        return ProcessedPrompt(ids, params, text, salt)

    def _check_params(self, params: SamplingParams) -> None:
        """Check the fields, then the per-request limits of the config (ValueError naming the
        field): no request can ask for unbounded work, e.g. n=100000 sequences."""
        params.validate()
        check_sampling_limits(params, self.config, self.vocab_size)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # cached for the engine
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as the model writes it at the start of the output and after a space."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a model with a tokenizer")
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt -> (its text if it has one, its ids). A dict with both keys is taken as
        already tokenized; its text is kept for outputs."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                _, ids = self._tokenize(list(prompt["prompt_token_ids"]))
                return (text if isinstance(text, str) else None), ids
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def _check_prompt_ids(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens long, but max_model_len is "
                f"{self.max_model_len} (prompt plus at least one output token)"
            )


def _cache_salt(prompt: PromptType) -> str | None:
    """The prompt dict's `cache_salt`: requests with different salts share no blocks."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    return salt
