"""PEFT LoRA adapters: read, checked against the base model, in the form the slots hold.

An adapter directory holds `adapter_config.json` (rank, alpha, rsLoRA, targets) and
`adapter_model.safetensors` with, per adapted projection, `...layers.<i>.<self_attn|mlp>.
<name>.lora_A.weight` [r, in] and `lora_B.weight` [out, r]. A projection's output gains
`scaling * (x @ A.T) @ B.T`, scaling `alpha / r` (rsLoRA: `alpha / sqrt(r)`); the scaling is
folded into B here. Anything forklift would have to ignore (DoRA, trained biases, adapted
embeddings or head, per-module alphas) is refused, so an adapter is served whole or not at
all.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from forklift.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Each fused projection of a decoder layer: the module holding it, its name, and the target
# modules it fuses in slice order (q, k, v are slices 0, 1, 2 of qkv_proj).
PROJECTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)
# Every target module, and the layer module holding it (as PEFT names its weights).
TARGET_OWNERS: Mapping[str, str] = MappingProxyType(
    {module: owner for owner, _, modules in PROJECTIONS for module in modules}
)
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.(?:[\w-]+\.)?weight$"
)


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (in, out) features in the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size),
        "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True)
class LoRAScaling:
    """What an adapter's config says about scaling its products."""

    alpha: float
    use_rslora: bool = False

    def of_rank(self, rank: int) -> float:
        return self.alpha / math.sqrt(rank) if self.use_rslora else self.alpha / rank


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: delta = x @ a.T @ b.T, with the scaling inside b."""

    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    scaling: LoRAScaling
    # (layer index, target module name) -> its weights.
    modules: Mapping[tuple[int, str], LoRAModule]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def read_scaling(path: Path) -> LoRAScaling:
    """The adapter config's scaling, after refusing what forklift cannot serve exactly."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LORA adapters run"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") != "none", "adapters with trained biases are not "
                 "supported"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not "
                          "supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "transposed (Conv1D) weights "
                           "are not supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "fully trained modules are "
                            "not supported"),
    }  # fmt: skip
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"LoRA adapter {str(path)!r}: {key}={config[key]!r}: {why}")
    alpha = config.get("lora_alpha", 8)
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"LoRA adapter {str(path)!r}: lora_alpha must be positive, got {alpha!r}")
    return LoRAScaling(float(alpha), bool(config.get("use_rslora", False)))


def load_adapter(
    path: str | Path, config: ModelConfig, max_rank: int, name: str | None = None
) -> LoRAAdapter:
    """Read and check a PEFT adapter directory against the base model's `config`; errors
    name the adapter by `name` (default: its path)."""
    from safetensors import safe_open

    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r} is not a directory")
    scaling = read_scaling(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE}")
    try:
        with safe_open(str(weights), framework="pt") as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {str(path)!r}: cannot read {WEIGHTS_FILE}: {exc}") from exc
    return build_adapter(name or str(path), tensors, scaling, config, max_rank)


def build_adapter(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    scaling: LoRAScaling,
    config: ModelConfig,
    max_rank: int,
) -> LoRAAdapter:
    """An adapter from PEFT-named tensors; every problem is a ValueError naming it."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight of a "
                "decoder layer's projection"
            )
        layer, module, side = int(match.group(1)), match.group(3), match.group(4)
        if module not in TARGET_OWNERS:
            raise ValueError(
                f"LoRA adapter {name!r}: unknown target module {module!r} (forklift adapts "
                f"{', '.join(TARGET_OWNERS)})"
            )
        if layer >= config.num_layers:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} names layer {layer}, but the base model "
                f"has {config.num_layers} layers"
            )
        pairs.setdefault((layer, module), {})[side] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights")
    shapes = target_shapes(config)
    modules = {}
    for (layer, module), sides in sorted(pairs.items()):
        where = f"LoRA adapter {name!r}, layer {layer} {module}"
        if set(sides) != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise ValueError(f"{where}: {missing} is missing")
        a, b = sides["A"], sides["B"]
        fan_in, fan_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                "[r, in] and [out, r]"
            )
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise ValueError(
                f"{where}: shapes [r, {a.shape[1]}] / [{b.shape[0]}, r] do not fit the base "
                f"model's [{fan_out}, {fan_in}] projection (an adapter of another base?)"
            )
        rank = a.shape[0]
        if rank < 1:
            raise ValueError(f"{where}: rank 0 (empty lora_A / lora_B)")
        if rank > max_rank:
            raise ValueError(f"{where}: rank {rank} is above max_lora_rank ({max_rank})")
        a32 = a.detach().to(torch.float32).contiguous()
        b32 = (b.detach().to(torch.float32) * scaling.of_rank(rank)).contiguous()
        modules[(layer, module)] = LoRAModule(a32, b32)
    return LoRAAdapter(name, scaling, modules)
