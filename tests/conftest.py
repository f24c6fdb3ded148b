from __future__ import annotations

import os

import pytest

from forklift.checkpoint.source import ModelSource, resolve_model
from forklift.cpu import simulated_cpu_kind, torch_environment

# FORKLIFT_CPU_KIND=avx2 runs the suite as on an AVX2-only CPU: torch's kernels are capped
# too, before any test runs one (the servers tests start inherit the caps).
if simulated_cpu_kind():
    for _name, _value in torch_environment(simulated_cpu_kind()).items():
        os.environ.setdefault(_name, _value)


def pytest_report_header() -> str:
    kind = simulated_cpu_kind()
    return f"forklift CPU kind: {'simulated ' + kind if kind else 'native'}"


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
