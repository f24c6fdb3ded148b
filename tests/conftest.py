from __future__ import annotations

import pytest

from forklift.checkpoint.source import ModelSource, resolve_model


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    """The default model, its GGUF parsed once for the whole session."""
    source = resolve_model(None)
    source.gguf_reader()
    return source


@pytest.fixture(scope="session")
def default_llm_fp32(default_source):
    from forklift import LLM

    return LLM(
        model=str(default_source.path),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 * 2**20,
        max_num_batched_tokens=512,
    )
