"""What a request's output must match: vLLM's `StructuredOutputsParams`, one option set."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain decoding to exactly one of:

    - `json`: a JSON schema (dict or JSON text) the output validates against;
    - `regex`: a regular expression the whole output matches;
    - `choice`: a list of strings, the output is one of them;
    - `grammar`: a context-free grammar, GBNF / EBNF (llama.cpp's notation) or Lark;
    - `json_object=True`: any JSON object.

    `param` names the request field it came from, for error messages (the server sets it to
    `response_format`, `structured_outputs`, `guided_json`, `tools`, ...).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON only: allow any whitespace between tokens (default: compact `,` and `:`).
    any_whitespace: bool = False
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Raise ValueError naming the field unless exactly one well-typed option is set."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                self.param,
                "needs exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(given) or "none"),
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, dict | str):
            raise StructuredOutputsError(self.param, "json must be a JSON schema object")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise StructuredOutputsError(self.param, f"{kind} must be a non-empty string")
        if kind == "choice" and (
            not isinstance(value, tuple)  # a bare string would pass as a list of characters
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise StructuredOutputsError(self.param, "choice must be a list of non-empty strings")
        if kind == "json_object" and value is not True:
            raise StructuredOutputsError(self.param, "json_object must be true")

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a `json` or `json_object` constraint."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise StructuredOutputsError(self.param, f"json is not valid JSON: {exc}") from exc
            if not isinstance(parsed, dict):
                raise StructuredOutputsError(self.param, "json must be a JSON schema object")
            return parsed
        assert isinstance(self.json, dict)
        return self.json

    def cache_key(self) -> str:
        """Equal constraints share one compiled grammar."""
        if self.kind in ("json", "json_object"):
            return f"json:{self.any_whitespace}:" + json.dumps(self.schema(), sort_keys=True)
        value = getattr(self, self.kind)
        return f"{self.kind}:" + (json.dumps(list(value)) if self.kind == "choice" else value)


class StructuredOutputsError(ValueError):
    """A constraint that is malformed or does not compile; `param` is the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
