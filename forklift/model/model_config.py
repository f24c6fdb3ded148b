"""Architecture description of a decoder-only model, independent of where its weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma3")
# Architectures whose decoder layer is the plain Llama layer (the compiled regions and the
# native decode step run exactly that layer).
LLAMA_LAYER_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# Attention over the last `sliding_window` positions only (Gemma 3's local layers).
SLIDING_ATTENTION = "sliding_attention"

# HF `architectures[0]` / `model_type` -> forklift architecture name.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    # The text model of a vision-language checkpoint; its vision tower is not loaded.
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Gemma3ForCausalLM": "gemma3",
}
_HF_MODEL_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "gemma3_text": "gemma3"}
# HF `hidden_activation` / `hidden_act` -> forklift's name of the MLP's gate activation.
_ACTIVATIONS = MappingProxyType(
    {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Shape of a Gated DeltaNet layer: a short causal convolution over the fused q/k/v
    projection, then the gated delta rule with a [key_dim, value_dim] state per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    def conv_state_elements(self) -> int:
        """The last conv_kernel - 1 inputs of every channel."""
        return (self.conv_kernel - 1) * self.conv_channels

    def recurrent_state_elements(self) -> int:
        return self.num_value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Qwen2 adds a bias to the q/k/v projections; Qwen3 adds RMS norms on q and k per head;
    Mistral may restrict attention to a sliding window. Qwen3.5 is hybrid: `layer_types` names
    each layer full or linear (Gated DeltaNet) attention; its full-attention layers gate their
    output, rotate only `partial_rotary_factor` of each head and use zero-centred norms.
    Gemma 3 interleaves sliding-window layers (their own rotary base) with full ones, scales
    its embedding, norms the output of attention and MLP too, and gates with GELU.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Empty: every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    partial_rotary_factor: float = 1.0
    # Full attention multiplies its output by sigmoid(gate), the gate a second half of q_proj.
    attention_output_gate: bool = False
    # Norm weights are stored as w - 1 (the norm scales by 1 + w).
    zero_centred_norms: bool = False
    # o_proj has a bias (Qwen3.5 with attention_bias).
    o_proj_bias: bool = False
    # The rotary base of sliding-window layers (None: rope_theta, as full layers).
    local_rope_theta: float | None = None
    # Attention logits are scaled by this (None: head_dim ** -0.5).
    attention_multiplier: float | None = None
    # The embedding lookup is multiplied by this (Gemma: sqrt(hidden_size)).
    embedding_multiplier: float = 1.0
    # The MLP's gate activation: "silu" or "gelu_tanh".
    mlp_activation: str = "silu"
    # Norms after attention and after the MLP too, before each residual add (Gemma 3).
    sandwich_norms: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"forklift supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types names {len(self.layer_types)} layers, but the model has "
                    f"{self.num_layers}"
                )
            unknown = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION}
            if unknown:
                raise ValueError(f"unsupported layer_types {sorted(unknown)}")
            if LINEAR_ATTENTION in self.layer_types and self.linear_attention is None:
                raise ValueError("linear_attention layers need the linear attention shape")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")
        if self.mlp_activation not in _ACTIVATIONS.values():
            raise ValueError(f"unsupported MLP activation {self.mlp_activation!r}")
        la = self.linear_attention
        if la is not None and la.num_value_heads % la.num_key_heads != 0:
            raise ValueError(
                f"linear_num_value_heads ({la.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({la.num_key_heads})"
            )

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a KV cache (full or sliding-window attention)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) != LINEAR_ATTENTION)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to the last `sliding_window` positions only,
        where other layers attend to everything (Gemma 3)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == SLIDING_ATTENTION)

    @property
    def uniform_window(self) -> int | None:
        """The window every attention layer keeps (Mistral); None where layers differ."""
        return None if self.sliding_layers else self.sliding_window

    @property
    def has_llama_layers(self) -> bool:
        return self.architecture in LLAMA_LAYER_ARCHITECTURES

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers, which keep a state per sequence instead."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_proj_size(self) -> int:
        """Rows of q_proj: the queries, and as many gate values with an output gate."""
        return 2 * self.q_size if self.attention_output_gate else self.q_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the contents of an HF `config.json`."""
        archs = hf.get("architectures") or []
        arch = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
        if arch is None:
            arch = hf.get("model_type", "")
            arch = _HF_MODEL_TYPES.get(arch, arch)
            if arch not in SUPPORTED_ARCHITECTURES:
                raise ValueError(
                    f"unsupported model architecture {archs or arch!r}; forklift supports "
                    f"{', '.join(_HF_ARCHITECTURES)}"
                )
        if arch == "qwen3_5" and isinstance(hf.get("text_config"), dict):
            # A vision-language checkpoint: the language model's settings are nested.
            text = dict(hf["text_config"])
            text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
            hf = text
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers >= 5 nests rope settings under `rope_parameters`.
        rope_params = hf.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        hybrid = _hybrid_fields(hf, int(hf["num_hidden_layers"])) if arch == "qwen3_5" else {}
        gemma = _gemma3_fields(hf, int(hf["num_hidden_layers"]), hidden) if arch == "gemma3" else {}
        if gemma:
            rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
        if isinstance(rope_params, dict) and arch == "qwen3_5":
            # Qwen3.5's rope type names its multimodal sections, which text positions ignore.
            if rope_params.get("rope_type", "default") in ("default", "mrope"):
                rope_scaling = None
        sliding = None
        if arch in ("mistral", "gemma3") or hf.get("use_sliding_window", False):
            sliding = hf.get("sliding_window")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            # Gemma ties its head unless the config says otherwise.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_5", "gemma3"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **hybrid,
            **gemma,
        )


def _hybrid_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3.5's extra settings: where the linear layers sit and their shape."""
    layer_types = hf.get("layer_types")
    if not layer_types:
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)
        ]
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return {
        "layer_types": tuple(layer_types),
        "linear_attention": LinearAttentionConfig(
            num_key_heads=int(hf.get("linear_num_key_heads", 16)),
            num_value_heads=int(hf.get("linear_num_value_heads", 32)),
            key_head_dim=int(hf.get("linear_key_head_dim", 128)),
            value_head_dim=int(hf.get("linear_value_head_dim", 128)),
            conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        ),
        "partial_rotary_factor": float(factor),
        "attention_output_gate": True,
        "zero_centred_norms": True,
        "o_proj_bias": bool(hf.get("attention_bias", False)),
    }


def _gemma3_fields(hf: dict[str, Any], num_layers: int, hidden: int) -> dict[str, Any]:
    """Gemma 3's extra settings: where the sliding layers sit, the rotary base of each kind
    (transformers >= 5 keys them by layer type in `rope_parameters`), and the scalings."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"Gemma 3 configs with {key} are not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 configs with use_bidirectional_attention are not supported")
    layer_types = hf.get("layer_types")
    if not layer_types:
        pattern = int(hf.get("sliding_window_pattern", 6))
        layer_types = [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
        ]
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    full = dict(rope.get(FULL_ATTENTION) or {})
    local = rope.get(SLIDING_ATTENTION) or {}
    theta = full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
    scaling = full if full.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported Gemma 3 hidden_activation {activation!r}")
    return {
        "layer_types": tuple(layer_types),
        "rope_theta": float(theta),
        "rope_scaling": scaling or None,
        "local_rope_theta": float(
            local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        ),
        "attention_multiplier": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "embedding_multiplier": hidden**0.5,
        "mlp_activation": _ACTIVATIONS[activation],
        "sandwich_norms": True,
        "zero_centred_norms": True,
    }
