"""The request fields that constrain output, OpenAI's and vLLM's, -> StructuredOutputsParams.

OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema"}. vLLM:
`structured_outputs` {json | regex | choice | grammar | json_object} and the older top-level
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one may be given.
"""

from __future__ import annotations

from typing import Any

from forklift.server.errors import APIError
from forklift.structured.params import StructuredOutputsError, StructuredOutputsParams

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OPTIONS = ("json", "regex", "choice", "grammar", "json_object")


def structured_params(
    response_format: Any, structured_outputs: Any, extra: dict[str, Any]
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, or None; 400 naming the field when malformed."""
    candidates: list[StructuredOutputsParams] = []
    try:
        if response_format is not None:
            found = _from_response_format(response_format)
            if found is not None:
                candidates.append(found)
        if structured_outputs is not None:
            candidates.append(_from_structured_outputs(structured_outputs))
        for name, option in GUIDED_FIELDS.items():
            if extra.get(name) is not None:
                candidates.append(StructuredOutputsParams(**{option: extra[name]}, param=name))
    except StructuredOutputsError as exc:
        raise APIError(400, str(exc), exc.param) from exc
    except TypeError as exc:  # a constructor keyword the user made up
        raise APIError(400, str(exc), "structured_outputs") from exc
    if len(candidates) > 1:
        names = ", ".join(c.param for c in candidates)
        raise APIError(
            400, f"give one output constraint, not several: {names}", candidates[1].param
        )
    return candidates[0] if candidates else None


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise StructuredOutputsError(param, "must be an object with a `type`")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param=param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputsError(
                f"{param}.json_schema", "must be an object with `name` and `schema`"
            )
        schema = spec.get("schema")
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name alone: any object
        if not isinstance(schema, dict):
            raise StructuredOutputsError(f"{param}.json_schema.schema", "must be an object")
        return StructuredOutputsParams(json=schema, param=param)
    raise StructuredOutputsError(
        f"{param}.type", f"must be text, json_object or json_schema, got {kind!r}"
    )


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredOutputsError(param, "must be an object")
    options = {k: v for k, v in value.items() if k in _STRUCTURED_OPTIONS and v is not None}
    whitespace = bool(value.get("disable_any_whitespace") is False)
    return StructuredOutputsParams(**options, any_whitespace=whitespace, param=param)
