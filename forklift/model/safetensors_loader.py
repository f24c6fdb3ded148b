"""Read a Hugging Face style model directory: `config.json` plus `*.safetensors` shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import safetensors
import torch

from forklift.checkpoint.tensors import is_derived
from forklift.model.model_config import ModelConfig

# Pickle-based checkpoint formats; loading them could execute arbitrary code, so they are refused.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def load_hf_model_config(model_dir: Path) -> ModelConfig:
    """Parse `model_dir/config.json` into a `ModelConfig`."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{config_path} not found: a Hugging Face model directory needs one")
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(hf).__name__}")
    try:
        return ModelConfig.from_hf_config(hf)
    except KeyError as exc:
        raise ValueError(f"{config_path} lacks the required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{config_path}: {exc}") from exc


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight shards of `model_dir`, in a stable order; refuses pickle-only checkpoints."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickled)}); forklift loads "
            "only safetensors and GGUF weights (pickle files can run arbitrary code). "
            "Convert the checkpoint to safetensors first."
        )
    raise ValueError(f"{model_dir} contains no *.safetensors weight files")


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every `(hf_name, tensor)` stored in the directory's safetensors shards."""
    for path in safetensors_files(model_dir):
        yield from _iter_file(path)


def _iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if is_derived(name):
                    continue
                yield name, handle.get_tensor(name)
    except (safetensors.SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
