"""Hugging Face transformers as the reference: the same weights in its model class, and
`generate()` with static batches (the baseline). transformers is imported lazily."""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass

import torch

from forklift.checkpoint.source import ModelSource
from forklift.model.model_config import ModelConfig
from forklift.model.model_source import iter_model_weights


@dataclass
class StaticBatchResult:
    wall_s: float
    # Tokens each request asked for, as generated (each batch runs to its longest request).
    outputs: list[list[int]]
    token_slots: int

    @property
    def useful_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def _transformers():  # noqa: ANN202 - the module
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(
            "the HF baseline needs transformers: pip install 'transformers>=4.50'"
        ) from exc
    return transformers


def load_hf_model(source: ModelSource, config: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The same weights in transformers' own model class."""
    transformers = _transformers()
    if source.format == "hf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    else:
        model = _from_gguf(transformers, source, config)
    model = model.to(dtype).eval()
    # Static batching runs every request to the batch's longest; nothing stops early.
    model.generation_config.eos_token_id = None
    return model


def _from_gguf(transformers, source: ModelSource, config: ModelConfig) -> torch.nn.Module:  # noqa: ANN001
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[config.architecture]
    hf_config = config_cls(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    with _no_init_weights():  # every weight is loaded next: 4 s of random init saved
        model = model_cls(hf_config).float()
    missing, unexpected = model.load_state_dict(
        dict(iter_model_weights(source, config)), strict=False
    )
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not fit transformers' model: {missing} {unexpected}")
    model.tie_weights()
    return model


def _no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' switch that skips random initialisation (its home moved in v5)."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def run_static_batches(
    model: torch.nn.Module,
    prompts: list[list[int]],
    output_lengths: list[int],
    batch_size: int,
    pad_token_id: int,
) -> StaticBatchResult:
    """Batches in arrival order, left-padded; each runs until its longest request is done."""
    outputs: list[list[int]] = []
    slots = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        lengths = output_lengths[first : first + batch_size]
        longest = max(lengths)
        generated = _generate(model, batch, longest, pad_token_id)
        slots += len(batch) * longest
        outputs += [tokens[:wanted] for tokens, wanted in zip(generated, lengths, strict=True)]
    return StaticBatchResult(time.perf_counter() - start, outputs, slots)


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of a batch, padded on the left as `generate()` wants."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _generate(
    model: torch.nn.Module, batch: list[list[int]], new_tokens: int, pad_token_id: int
) -> list[list[int]]:
    ids, mask = left_padded(batch, pad_token_id)
    width = ids.shape[1]
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    return out[:, width:].tolist()
