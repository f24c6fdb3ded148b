"""forklift: a high-throughput LLM inference engine with a paged KV cache."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from forklift.version import __version__

# Public names resolve lazily, so the pure-Python engine core imports without loading torch.
_EXPORTS = {
    "LLM": "forklift.llm",
    "LLMEngine": "forklift.engine.engine",
    "EngineConfig": "forklift.config",
    "SamplingParams": "forklift.sampling_params",
    "StructuredOutputsParams": "forklift.structured.params",
    "RequestOutput": "forklift.outputs",
    "CompletionOutput": "forklift.outputs",
    "Logprob": "forklift.outputs",
    "LoRARequest": "forklift.lora_request",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:
    from forklift.config import EngineConfig
    from forklift.engine.engine import LLMEngine
    from forklift.llm import LLM
    from forklift.lora_request import LoRARequest
    from forklift.outputs import CompletionOutput, Logprob, RequestOutput
    from forklift.sampling_params import SamplingParams
    from forklift.structured.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'forklift' has no attribute {name!r}")
