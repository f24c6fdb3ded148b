"""`speculative_config`: vLLM's keys, checked once, so a bad config is a ValueError naming
the key before any model loads."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

# Methods forklift proposes with; vLLM's other names are refused with a clear error.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "mtp")
_NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator")
# vLLM's model-specific names for the MTP method.
_MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp")
# Longest run of drafts one sequence may carry into a step.
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. Drafts are checked in the target's own step, so greedy
    output is unchanged and sampled output keeps the target's distribution."""

    method: str
    # Drafts per sequence and step (suffix: the most; each proposal may be shorter).
    num_speculative_tokens: int
    # n-gram: the longest and shortest tail of the sequence looked up in its earlier tokens.
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # No drafts while this many sequences or more are running (None: always speculate).
    disable_by_batch_size: int | None = None
    # forklift's own key: size each sequence's drafts by its recent acceptance and the
    # number running (core/draft_budget.py); False always proposes up to
    # num_speculative_tokens.
    adaptive_draft_length: bool = True
    # suffix: the tries' depth (match plus drafts), the finished requests whose outputs are
    # kept, drafts per matched token, and the lowest estimated chance a draft may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the draft (a path or name, as the target's `model`; None: the target
    # itself) and forklift's own key for the self-speculative form: run only the draft's
    # first this-many layers, then its final norm and head (None: all of them).
    model: str | None = None
    draft_layers: int | None = None

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """A config from a dict (`LLM(speculative_config=...)`) or its JSON text (the
        command line's `--speculative-config`); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        return cls._from_dict(dict(value))

    @classmethod
    def _from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                f"known keys are {', '.join(sorted(known))}"
            )
        method = values.get("method")
        if method is None and values.get("model") in ("ngram", "[ngram]"):
            method = values.pop("model").strip("[]")  # vLLM's older spelling
        if method is None and values.get("model") is not None:
            method = "draft_model"  # vLLM infers the method from a draft model's name
        if method in _MTP_ALIASES:
            method = "mtp"
        if method in _NOT_BUILT:
            raise ValueError(
                f"speculative_config: method {method!r} is not supported yet; forklift "
                f"speculates with {', '.join(repr(m) for m in SPECULATIVE_METHODS)}"
            )
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                f"got {method!r}"
            )
        values["method"] = method
        if method != "draft_model":
            values.pop("model", None)  # vLLM's name for the proposer's model: the target here
        if "num_speculative_tokens" not in values:
            if method != "suffix":
                raise ValueError(
                    f"speculative_config: method {method!r} needs num_speculative_tokens"
                )
            values["num_speculative_tokens"] = values.get("suffix_decoding_max_tree_depth", 24)
        # One bound given: the other follows it, as in vLLM.
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], 2)
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"], 5)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, None)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, None)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 2, None)
        if not isinstance(self.adaptive_draft_length, bool):
            raise ValueError(
                "speculative_config: adaptive_draft_length must be true or false, "
                f"got {self.adaptive_draft_length!r}"
            )
        _int_in("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2, 256)
        _int_in(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0, None
        )
        factor = self.suffix_decoding_max_spec_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(
                f"speculative_config: suffix_decoding_max_spec_factor must be a positive "
                f"number, got {factor!r}"
            )
        prob = self.suffix_decoding_min_token_prob
        if not isinstance(prob, int | float) or isinstance(prob, bool) or not 0 <= prob <= 1:
            raise ValueError(
                f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], "
                f"got {prob!r}"
            )
        self._validate_draft()

    def _validate_draft(self) -> None:
        if self.method != "draft_model":
            if self.draft_layers is not None:
                raise ValueError(
                    "speculative_config: draft_layers belongs to method 'draft_model', "
                    f"not {self.method!r}"
                )
            return
        if self.model is None and self.draft_layers is None:
            raise ValueError(
                "speculative_config: method 'draft_model' needs model (a smaller model with "
                "the target's tokenizer) or draft_layers (the target's own first layers)"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                f"speculative_config: model must be a path or model name, got {self.model!r}"
            )
        if self.draft_layers is not None:
            _int_in("draft_layers", self.draft_layers, 1, None)


def _int_in(name: str, value: object, low: int, high: int | None) -> None:
    bad = not isinstance(value, int) or isinstance(value, bool)
    if bad or value < low or (high is not None and value > high):  # type: ignore[operator]
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative_config: {name} must be an integer {bounds}, got {value!r}")
