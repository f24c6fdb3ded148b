"""EngineConfig: every engine knob in one place, validated once, with vLLM's names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forklift.cpu import cpu_has_fast_bf16
from forklift.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

# vLLM's option name and values (the subset forklift has kernels for).
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
DECODE_BACKENDS = ("auto", "native", "torch")
# kv_cache_dtype names of plain values in a dtype of their own; the rest but "auto" are
# one-byte codes with a scale per row.
PLAIN_KV_CACHE_DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", *PLAIN_KV_CACHE_DTYPES, "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


# Accepted dtype names -> torch's names (torch is imported only to resolve them, so plain
# configuration never loads it).
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


# vLLM's largest LoRA rank; the native step keeps a step's adapter sums on the stack.
MAX_LORA_RANK = 512


@dataclass
class EngineConfig:
    """Knobs of one engine. Unknown names are rejected by `from_kwargs`."""

    # Path to an HF model directory or a GGUF file; None = the default model.
    model: str | None = None
    # "auto" = bfloat16 where the hardware is good at it (GPU, CPU with AMX/AVX512-BF16), else fp32.
    dtype: str = "auto"
    # Weight-only quantization: "auto" serves a GGUF file at its own precision (Q4_0 / Q4_1 as
    # int4, Q8_0 as int8) on a CPU unless dtype is explicitly float32 / float16, and keeps HF
    # directories dense; "none" dequantizes to dtype; "int8" / "int4" round any model's
    # weights at load. Quantized layers compute in bf16.
    quantization: str = "auto"
    # Kernels of the quantized decode path on a CPU: "native" = forklift's C block kernels
    # (integer dot products, built on first use for the CPU at hand); "torch" = PyTorch's
    # int4/int8 kernels; "auto" = native where it builds, else torch (the log says why).
    decode_backend: str = "auto"
    # One forward for every step where the native step runs a model's block weights (or its
    # dense bf16 weights on AMX or AVX512-BF16): a request's tokens and logprobs are bitwise
    # the same whatever shares its steps, however its prompt is chunked and whatever the prefix
    # cache holds, and no dense copy of a quantized weight is kept. False: prefill chunks
    # and large steps run the PyTorch layers, on dense copies of block weights (faster
    # prefill on CPUs with AMX, about twice the weights' memory) or oneDNN's GEMM, with
    # answers that may change with the batch.
    batch_invariant: bool = True
    # "auto" = CUDA when available, else CPU.
    device: str = "auto"
    # Tokens per KV-cache block.
    block_size: int = 16
    # How the KV cache stores K/V (vLLM's names): "auto" = bf16 on a CPU when dtype is
    # "auto" (also where the model computes in fp32: half the bytes a decode step reads),
    # else the model's dtype; "bfloat16" or "float32" = those values; "int8", "fp8"
    # (= "fp8_e4m3") or "fp8_e5m2" = one-byte codes with a float32 scale per token and KV
    # head (about twice the tokens in the same memory, half the bytes a decode step reads;
    # int8 is the most precise of the three; docs/architecture.md).
    kv_cache_dtype: str = "auto"
    # Longest prompt + output; None = the model's context length.
    max_model_len: int | None = None
    # Most sequences in one step.
    max_num_seqs: int = 256
    # Token budget of one step (prefill chunks + decodes); None = max(2048, max_num_seqs).
    max_num_batched_tokens: int | None = None
    # Fraction of device memory (CPU: of RAM) the engine may fill with weights, activations
    # and KV cache. None = 0.9 on a GPU; 0.5 on a CPU, whose RAM the OS and other programs share.
    gpu_memory_utilization: float | None = None
    # Exact KV-cache size in bytes; overrides gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    # Exact number of KV-cache blocks (vLLM's name; the null block included); overrides both
    # budgets above. Unlike a size in bytes it means the same tokens in any dtype.
    num_gpu_blocks_override: int | None = None
    # Most prompt tokens a step may prefill while running requests decode (all its prefill
    # chunks together): a new prompt then joins over several steps instead of stalling every
    # stream for one long step. None or 0 = no bound beyond max_num_batched_tokens, the
    # default everywhere, `forklift serve` included: fewer, larger prefill steps served
    # faster when measured (docs/serving.md). Steps without decodes prefill at the full
    # budget.
    decode_step_prefill_tokens: int | None = None
    # Spread the pending prompt tokens over about this many decoding steps (each step
    # prefills pending / steps, at least 16 tokens, at most the bound above, or the token
    # budget without one), so steps cost about the same. None or 0 = off (the default): a
    # step prefills up to the bound.
    prefill_pace_steps: int | None = None
    # Reuse the KV blocks of earlier requests that share a token prefix.
    enable_prefix_caching: bool = True
    # Seed for requests that bring none of their own.
    seed: int = 0
    # Torch intra-op threads on CPU; None = torch's default.
    num_threads: int | None = None
    # False: pure-decode steps run captured (CUDA graphs on a GPU, compiled layer regions on
    # a CPU) at padded batch-size buckets. None = auto: captured on a GPU, eager on a CPU,
    # where `forklift bench decode` measures no gain from compiling (docs/architecture.md).
    enforce_eager: bool | None = None
    # Ranks the model's layers are split across (processes on this machine; gloo on a CPU,
    # NCCL on GPUs). Must not exceed the model's KV heads.
    tensor_parallel_size: int = 1
    # Permit a tensor-parallel group whose ranks sit on different machines (loudly warned).
    allow_cross_node_tensor_parallel: bool = False
    # Batch-size buckets of captured decode; None = 1, 2, 4, 8, 16, 24, 32, ... max_num_seqs.
    decode_capture_sizes: tuple[int, ...] | None = None
    # Speculative decoding with vLLM's keys ({"method": "ngram", "num_speculative_tokens": 4,
    # ...}, or its JSON text); None = off. Parsed into a SpeculativeConfig.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # LoRA adapters (vLLM's names): requests may name a PEFT adapter (LoRARequest); up to
    # max_loras adapters run in one step (device slots, reserved before the KV cache is
    # sized), each of rank up to max_lora_rank; host copies of up to max_cpu_loras adapters
    # (None = max_loras) are kept for reloading evicted slots.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Per-request limits, checked before a request is queued (a ValueError naming the field;
    # HTTP 400 from the server). They bound the work one request can ask for.
    # Samples per request (`n`): each is a sequence the engine thread creates and schedules.
    max_n: int = 128
    # Top logprobs per token (`logprobs`, chat's `top_logprobs`); vLLM's name and default.
    max_logprobs: int = 20
    # Stop strings per request, and characters per stop string (matched after every token).
    max_stop_strings: int = 32
    max_stop_string_chars: int = 512
    # Entries of `stop_token_ids`.
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"valid arguments are: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)

    def validate(self) -> None:
        if not (self.dtype == "auto" or self.dtype in _DTYPES):
            raise ValueError(
                f"dtype must be 'auto' or one of {', '.join(_DTYPES)}; got {self.dtype!r}"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                f"got {self.quantization!r}"
            )
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(
                f"decode_backend must be one of {', '.join(DECODE_BACKENDS)}; "
                f"got {self.decode_backend!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]'; got {self.device!r}")
        validate_kv_cache_dtype(self.kv_cache_dtype)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len, optional=True)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        _positive("num_gpu_blocks_override", self.num_gpu_blocks_override, optional=True)
        _off_or_positive("prefill_pace_steps", self.prefill_pace_steps, "off")
        _off_or_positive("decode_step_prefill_tokens", self.decode_step_prefill_tokens, "no bound")
        _positive("num_threads", self.num_threads, optional=True)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        for limit in ("max_n", "max_logprobs", "max_stop_strings", "max_stop_string_chars",
                      "max_stop_token_ids"):  # fmt: skip
            _positive(limit, getattr(self, limit))
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(
                f"enforce_eager must be True, False or None, got {self.enforce_eager!r}"
            )
        if self.decode_capture_sizes is not None:
            self.decode_capture_sizes = tuple(self.decode_capture_sizes)
            if not self.decode_capture_sizes:
                raise ValueError("decode_capture_sizes must not be empty")
            for size in self.decode_capture_sizes:
                _positive("decode_capture_sizes", size)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}"
            )
        _positive("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        util = self.gpu_memory_utilization
        if util is not None and not (0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA device is available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32

    def resolve_kv_cache_dtype(self, device: torch.device) -> str:
        """kv_cache_dtype with "auto" settled where it departs from the model's dtype: a CPU
        keeps K/V in bf16 unless a dtype was asked for (an fp32 model's cache rows widen
        exactly to fp32 inside attention, and attention reads half the bytes)."""
        if self.kv_cache_dtype == "auto" and device.type == "cpu" and self.dtype == "auto":
            return "bfloat16"
        return self.kv_cache_dtype

    def resolve_enforce_eager(self, device: torch.device) -> bool:
        if self.enforce_eager is not None:
            return self.enforce_eager
        return device.type != "cuda"

    def resolve_memory_utilization(self, device: torch.device) -> float:
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.9 if device.type == "cuda" else 0.5

    def resolve_decode_step_prefill_tokens(self) -> int | None:
        """The scheduler's bound (None: unbounded)."""
        return self.decode_step_prefill_tokens or None

    def resolve_prefill_pace_steps(self) -> int | None:
        """The scheduler's pace (None: off)."""
        return self.prefill_pace_steps or None

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (validate() parsed it)."""
        assert not isinstance(self.speculative_config, dict | str)
        return self.speculative_config

    def resolve_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def resolve_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(2048, self.max_num_seqs)


def validate_kv_cache_dtype(name: object) -> None:
    """A ValueError naming the field for anything but a supported name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}"
        )


def _off_or_positive(name: str, value: int | None, zero_means: str) -> None:
    """None or 0 (which means `zero_means`) or a positive integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"{name} must be None or 0 ({zero_means}) or a positive integer; got {value!r}"
        )


def _positive(name: str, value: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
