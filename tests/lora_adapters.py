"""PEFT adapters on tiny models, made by the `peft` package, and their HF + PEFT oracle."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from forklift.model.lora import TARGET_OWNERS

ALL_TARGETS = tuple(TARGET_OWNERS)


@dataclass
class Adapter:
    path: Path
    # The base model with this adapter applied: HF + PEFT, the oracle.
    hf_model: torch.nn.Module


def make_adapter(
    base: torch.nn.Module,
    directory: Path,
    rank: int,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 0,
    alpha: float | None = None,
    use_rslora: bool = False,
    std: float = 0.3,
) -> Adapter:
    """A random adapter (B is not zero, so it changes the output) saved as PEFT saves it."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # PEFT's random init is tiny against these wide tiny models
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, std)
    model.save_pretrained(directory)
    return Adapter(directory, model)
