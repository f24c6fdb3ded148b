"""A whole decode step in one native call (csrc/decode_step.c), for the Llama family and
Gemma 3: the C structs a model is bound into and the ctypes wrapper of the call.

A `BoundModel` (model/native_binding.py's `StepBinding`) holds the model's structs of raw
pointers (weights, norms, rotary tables, each layer's KV cache); a step then passes only its
index tensors.

What the C side owns: nothing beyond one step (its scratch is allocated and freed per
call). What it writes: each row's new K and V into the cache slot given, and the logits.
"""

from __future__ import annotations

import ctypes
import functools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from forklift.native.build import load_native_library

PROFILER_NAME = "forklift::native_decode_step"


class StepQuantWeight(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("precise", ctypes.c_int32),
        ("dense", ctypes.c_int32),
    ]


class StepLoRA(ctypes.Structure):
    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("ranks", ctypes.c_void_p),
        ("slice_starts", ctypes.c_void_p),
        ("slices", ctypes.c_int64),
        ("max_rank", ctypes.c_int64),
    ]


class StepLinearLayer(ctypes.Structure):
    """A Gated DeltaNet layer's own tensors (csrc/gated_deltanet.h's LinearLayer)."""

    _fields_ = [
        ("conv_weight", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
        ("a_log", ctypes.c_void_p),
        ("norm", ctypes.c_void_p),
        ("conv_states", ctypes.c_void_p),
        ("recurrent_states", ctypes.c_void_p),
    ]


class StepLinearShape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel")
    ]


# A layer's token mixer (csrc/decode_step.c's LAYER_*).
LAYER_ATTENTION = 0
LAYER_LINEAR = 1


class StepLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("qkv", StepQuantWeight),
        ("o", StepQuantWeight),
        ("gate_up", StepQuantWeight),
        ("down", StepQuantWeight),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("group", ctypes.c_int64),
        ("lora_qkv", StepLoRA),
        ("lora_o", StepLoRA),
        ("lora_gate_up", StepLoRA),
        ("lora_down", StepLoRA),
        ("kind", ctypes.c_int64),
        ("output_gate", ctypes.c_int64),
        ("linear", StepLinearLayer),
    ]


class _StepGroup(ctypes.Structure):
    _fields_ = [
        ("slots", ctypes.c_void_p),
        ("blocks", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class StepModel(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_int64) for name in (
            "num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
            "rotary_dim", "num_blocks", "block_size")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("is_bf16", ctypes.c_int),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("head", StepQuantWeight),
        ("layers", ctypes.POINTER(StepLayer)),
        ("norm_offset", ctypes.c_float),
        ("embed_scale", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("embed_blocks", StepQuantWeight),
        ("cache_format", ctypes.c_int),
        ("linear", StepLinearShape),
        # Qwen3.5's MTP layer bound as a model: its input projection and the two norms before it.
        ("input_fc", StepQuantWeight),
        ("input_norm_embedding", ctypes.c_void_p),
        ("input_norm_hidden", ctypes.c_void_p),
    ]  # fmt: skip


class BoundModel(Protocol):
    """A model bound into the step's structs (what `NativeDecodeStep` reads of a binding)."""

    model: StepModel
    vocab: int
    hidden: int
    max_rows: int | None  # None: any number of rows
    num_groups: int


@dataclass(frozen=True)
class StepTimings:
    """Seconds native steps spent, summed over the steps timed."""

    matrix: float
    attention: float
    other: float


class NativeDecodeStep:
    """The loaded step library; construct through `load()`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.forklift_decode_step
        function.argtypes = [
            ctypes.POINTER(StepModel), ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(_StepGroup), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        function.restype = ctypes.c_int
        self._function = function
        self._library = library
        self._timings: ctypes.Array[ctypes.c_double] | None = None

    def start_timing(self) -> None:
        """Sum, from now on, the seconds each step spends in matmuls, attention and the rest
        (what `forklift bench profile` reports of a native step)."""
        self._timings = (ctypes.c_double * 3)()

    def stop_timing(self) -> StepTimings:
        timings = self._timings
        self._timings = None
        if timings is None:
            return StepTimings(0.0, 0.0, 0.0)
        return StepTimings(*timings)

    @functools.cached_property
    def dense_tiles(self) -> bool:
        """Whether dense bf16 weights run here: AMX tiles compiled in and granted (asked on
        first use: the request is a system call), or AVX512-BF16 dot products compiled in."""
        return bool(self._library.forklift_decode_step_dense_tiles())

    @classmethod
    def load(cls) -> NativeDecodeStep | None:
        library = load_native_library("decode_step")
        return None if library is None else cls(library)

    def __call__(
        self,
        binding: BoundModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        row_lora: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
        keep_hidden: bool = False,
        states: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_hidden: torch.Tensor | None = None,
    ) -> StepOutput:
        """One token per row (a decode row, or one token of a prompt chunk); K/V written in
        place. `groups`: each KV group's (slot mapping, key blocks, mask bias) of the step;
        `row_lora`: each row's LoRA slot (-1: none), or None when no row runs an adapter;
        `logit_rows`: the rows whose logits are wanted, ascending (None: every row);
        `keep_hidden`: also return every row's final normed hidden state; `states`: a
        hybrid model's per-row state slots (reads, writes: see csrc/gated_deltanet.h);
        `input_hidden`: an MTP layer's rows' input hidden states [rows, hidden]."""
        rows = input_ids.shape[0]
        limit = binding.max_rows
        if rows <= 0 or (limit is not None and rows > limit):
            raise ValueError(f"this native step runs 1-{limit or 'any'} rows, got {rows}")
        if len(groups) < binding.num_groups:
            raise ValueError(f"the model reads {binding.num_groups} KV groups, got {len(groups)}")
        ids = input_ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        kept = []  # the tensors the C structs point into, alive through the call
        structs = []
        for slot_mapping, kv_blocks, bias in groups:
            slots = slot_mapping.to(torch.int64).contiguous()
            blocks = kv_blocks.to(torch.int64).contiguous()
            bias = bias.reshape(rows, -1).to(torch.float32).contiguous()
            kept += [slots, blocks, bias]
            structs.append(_StepGroup(slots.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                                      bias.data_ptr()))  # fmt: skip
        group_array = (_StepGroup * len(structs))(*structs)
        lora_rows = None
        if row_lora is not None:
            lora_rows = row_lora.to(torch.int64).contiguous()
            kept.append(lora_rows)
        if logit_rows is None:
            logit_rows = torch.arange(rows, dtype=torch.int64)
        logit_rows = logit_rows.to(torch.int64).contiguous()
        if logit_rows.numel() and (
            int(logit_rows[0]) < 0 or int(logit_rows[-1]) >= rows
            or bool((logit_rows[1:] <= logit_rows[:-1]).any())
        ):  # fmt: skip
            raise ValueError("logit_rows must be ascending rows of the step")
        state_rows = (None, None)
        if states is not None:
            reads, writes = (t.to(torch.int64).contiguous() for t in states)
            if reads.shape != (rows,) or writes.shape != (rows,) or int(reads[0]) < 0:
                raise ValueError("state reads and writes need one slot per row, the first read")
            kept += [reads, writes]
            state_rows = (reads.data_ptr(), writes.data_ptr())
        elif binding.model.linear.value_heads:
            raise ValueError("a hybrid model's native step needs its rows' state slots")
        if input_hidden is not None:
            if not binding.model.input_fc.k:
                raise ValueError("input_hidden is an MTP layer's input; this binding has none")
            input_hidden = input_hidden.to(torch.float32).contiguous()
            if input_hidden.shape != (rows, binding.hidden):
                raise ValueError("input_hidden needs one [hidden] row per input id")
            kept.append(input_hidden)
        elif binding.model.input_fc.k:
            raise ValueError("an MTP layer's native step needs its rows' input hidden states")
        logits = torch.empty(logit_rows.numel(), binding.vocab, dtype=torch.float32)
        hidden = torch.empty(rows, binding.hidden, dtype=torch.float32) if keep_hidden else None
        profiling = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function(PROFILER_NAME) if profiling else nullcontext():
            failed = self._function(
                ctypes.byref(binding.model), rows, ids.data_ptr(), positions.data_ptr(),
                group_array, logits.data_ptr(), torch.get_num_threads(), self._timings,
                None if lora_rows is None else lora_rows.data_ptr(), logit_rows.data_ptr(),
                logit_rows.numel(), None if hidden is None else hidden.data_ptr(), *state_rows,
                None if input_hidden is None else input_hidden.data_ptr(),
            )  # fmt: skip
        if failed == 2:
            raise RuntimeError(
                "dense bf16 weights bound to a step library without a dense kernel "
                "(AMX-BF16 tiles or AVX512-BF16 dot products)"
            )
        if failed == 3:
            raise ValueError("a state chain cut by a chunk boundary stores its state nowhere")
        if failed == 4:
            raise ValueError("an MTP layer's input projection must map 2 x hidden to hidden")
        if failed:
            raise MemoryError("the native decode step could not allocate its scratch buffers")
        return StepOutput(logits, hidden)


@dataclass(frozen=True)
class StepOutput:
    """A native step's results: logits of the rows asked for; every row's final normed
    hidden state where asked."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
