"""Tiny random models of every supported architecture, saved the way HF saves them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from forklift.model.model_config import ModelConfig
from forklift.tokenizer import Tokenizer as ForkliftTokenizer

VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Wide weights give peaked distributions, so greedy choices are not near-ties.
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 24, "head_dim": 16},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"tie_word_embeddings": True},
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"head_dim": 32, "tie_word_embeddings": False},
    ),
    # A local (sliding-window) layer and a global one, the window shorter than most prompts,
    # a logit scale other than head_dim's and a global rotary base other than the local one.
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
}


@dataclass
class TinyModel:
    path: Path
    hf_model: torch.nn.Module


def word_level_tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def make_tiny_model(arch: str, directory: Path, seed: int = 0) -> TinyModel:
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = config_cls(**{**_COMMON, **extra})
    if arch == "qwen2":
        config.use_sliding_window = False
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    # Qwen2's q/k/v biases start at zero, Gemma's (zero-centred) norms at their identity; give
    # them values so those paths are exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0, 0.5)
            elif arch == "gemma3" and name.endswith("norm.weight"):
                param.normal_(0, 0.3)
    return _save(model, directory)


def _save(model: torch.nn.Module, directory: Path) -> TinyModel:
    """The model as an HF directory with a word-level tokenizer; the returned oracle never
    stops early (forklift runs with ignore_eos to match)."""
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.eos_token_id = None
    word_level_tokenizer(VOCAB).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    return TinyModel(directory, model)


def save_with_weight(
    tiny: TinyModel, source: Path, target: Path, name: str, value: torch.Tensor
) -> None:
    """Set the HF model's parameter `name` to `value` and save the model to `target`, with
    `source`'s tokenizer files: the checkpoint a weight update should be equal to."""
    with torch.no_grad():
        tiny.hf_model.get_parameter(name).copy_(value)
    tiny.hf_model.save_pretrained(target, safe_serialization=True)
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (target / extra).write_bytes((source / extra).read_bytes())


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int):
    """HF transformers' greedy continuation and each chosen token's logprob."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), dim=-1)[tok].item()
        for step, tok in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def random_linear(in_features: int, out_features: int, bias: bool = True):
    """forklift's Linear with random weights: the layer itself skips initialisation (a model's
    weights are always loaded), so a test that builds one alone fills it."""
    from forklift.model.layers.linear import Linear

    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, in_features**-0.5)
    return layer


def hf_teacher_forced(
    model: torch.nn.Module, prompt: list[int], continuation: list[int]
) -> torch.Tensor:
    """HF transformers' next-token log-probabilities after prompt + continuation[:i], row i,
    from one forward. Where each row's argmax is the continuation's token, the continuation
    is exactly HF's greedy one (by induction over positions), at a fraction of generate()'s
    cost on a large vocabulary."""
    ids = torch.tensor([prompt + continuation[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


# Tiny Qwen3.5 hybrids: Gated DeltaNet layers beside gated full attention. Each variant sets
# its own layers and heads over _COMMON.
HYBRID_VARIANTS = {
    # The released layout (three linear, one full), GQA in both kinds of layer.
    "interval": dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    ),
    # Full attention first, odd head counts, half the head rotated, tied embeddings.
    "odd-heads": dict(
        num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=3, num_key_value_heads=1, head_dim=20,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=6,
        linear_value_head_dim=10, linear_conv_kernel_dim=3, tie_word_embeddings=True,
    ),
    # Linear layers on both sides of a full one, no grouping in the linear layers.
    "sandwich": dict(
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    ),
}  # fmt: skip


def make_tiny_hybrid(variant: str, directory: Path, seed: int = 0, **overrides) -> TinyModel:
    return _save(tiny_hybrid_model(variant, seed, **overrides), directory)


def tiny_hybrid_model(variant: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random Qwen3.5 hybrid of one of HYBRID_VARIANTS (its settings over _COMMON)."""
    settings = {**_COMMON, **HYBRID_VARIANTS[variant], **overrides}
    config = transformers.Qwen3_5TextConfig(**settings)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF starts norms at their identity (and dt_bias at one); perturb them so the
            # zero-centred and gated norms and the decay are exercised.
            if name.endswith("norm.weight"):
                param.normal_(0, 0.3)
            elif name.endswith("dt_bias"):
                param.normal_(0, 1.0)
    return model


def make_tiny_byte_level_model(directory: Path, tokenizer: ForkliftTokenizer) -> TinyModel:
    """A tiny random Llama over a real byte-level BPE vocabulary (the default model's), so
    text such as JSON can be written token by token; random weights never write it alone."""
    config = transformers.LlamaConfig(
        **{
            **_COMMON,
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory)
    return TinyModel(directory, model)


def add_mtp_layer(tiny: TinyModel, seed: int = 0) -> dict[str, torch.Tensor]:
    """Give a saved tiny hybrid checkpoint a random multi-token prediction layer (Qwen3.5's
    `mtp.*` names: a full-attention decoder layer shaped as the model's, `fc`, three norms);
    returns the new tensors."""
    from safetensors.torch import load_file, save_file

    path = tiny.path / "model.safetensors"
    tensors = load_file(path)
    config = tiny.hf_model.config
    full = config.layer_types.index("full_attention")
    prefix = f"model.layers.{full}."
    gen = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    mtp = {
        "mtp." + name.replace(prefix, "layers.0."): torch.randn(t.shape, generator=gen) * 0.3
        for name, t in tensors.items()
        if name.startswith(prefix)
    }
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.3
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})
    return mtp


# One layer of the default model's shapes (SmolLM2-135M): for arithmetic on real sizes.
SMOLLM2_LIKE = ModelConfig(
    architecture="llama", vocab_size=49153, hidden_size=576,
    intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
)  # fmt: skip
