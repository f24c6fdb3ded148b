"""Per-request sampling settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from forklift.structured.params import StructuredOutputsParams

LOGPROBS_MODES = ("processed", "raw")
_INT64_LIMIT = 2**63


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature=0` means greedy. `logprobs=N` returns the sampled token's logprob plus the top N
    of one distribution, chosen by `logprobs_mode`:

    - "processed" (default): the distribution the token was actually drawn from, after
      penalties, temperature, top-k, top-p and min-p. Truncation renormalises over the kept
      tokens (dropped ones get -inf), so with top-k/top-p the logprobs are those of the
      truncated distribution. Greedy rows use the penalised logits without temperature.
    - "raw": the model's own distribution, log_softmax of its logits, before any processing.

    `structured_outputs` constrains every sample to a JSON schema, regex, choice or grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # The logprob of every prompt token after the first (and the top N at each position),
    # from the model's raw distribution; computed in the prefill, so such a request takes no
    # prefix-cache hit.
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed"
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> bias in [-100, 100], added to the logits before any
    # other processing (so `processed` logprobs include it); -100 bans in practice.
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only these token ids.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to complete. Each is tokenized (alone and after a space); a word's
    # last token is banned whenever the output ends with the rest of it.
    bad_words: list[str] | None = None
    # The bad words as token sequences, filled in by the input processor (it has the
    # tokenizer); not a request field.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        # Sizes become int64 tensors and floats feed the sampler: out-of-range integers and
        # NaN / infinity must be a clear error here, never an overflow on the engine thread.
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            _check(
                value is None or not isinstance(value, int) or abs(value) < _INT64_LIMIT,
                name,
                f"must be below 2**63, got {value}",
            )
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):  # fmt: skip
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and math.isfinite(value),
                name,
                f"must be a finite number, got {value}",
            )
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}",
        )
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"must be >= 0, got {self.min_tokens}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            # The upper bound is the engine's max_logprobs (forklift/core/request_limits.py).
            f"must be a non-negative integer, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
            "prompt_logprobs",
            f"must be a non-negative integer, got {self.prompt_logprobs}",
        )
        _check(
            self.logprobs_mode in LOGPROBS_MODES,
            "logprobs_mode",
            f"must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a list of non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative token ids",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        self._validate_token_choices()
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )

    def _validate_token_choices(self) -> None:
        bias = self.logit_bias
        _check(bias is None or isinstance(bias, dict), "logit_bias",
               "must be a dict of token id -> bias")  # fmt: skip
        for token, value in (bias or {}).items():
            _check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                "logit_bias",
                f"keys must be token ids (non-negative integers), got {token!r}",
            )
            _check(
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and -100 <= value <= 100,
                "logit_bias",
                f"values must be numbers in [-100, 100], got {value!r} for token {token}",
            )
        allowed = self.allowed_token_ids
        _check(
            allowed is None or (isinstance(allowed, list) and len(allowed) > 0),
            "allowed_token_ids",
            "must be a non-empty list of token ids",
        )
        _check(
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed or []),
            "allowed_token_ids",
            "must hold non-negative token ids",
        )
        _check(
            allowed is None or self.structured_outputs is None,
            "allowed_token_ids",
            "cannot be combined with structured_outputs (the grammar decides the tokens)",
        )
        words = self.bad_words
        _check(
            words is None
            or (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)),
            "bad_words",
            "must be a list of non-empty strings",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")
