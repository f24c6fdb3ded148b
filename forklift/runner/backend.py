"""Which kernels run a runner's steps: the native step (one call per step, on block weights or
on dense bf16 weights), the PyTorch layers on the native block matmuls, or PyTorch alone.
Chosen and loaded once, from the decode backend asked for, the quantization and this
machine; the native step is bound to the weights and cache here and run on a step's inputs."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from forklift.core.scheduler_output import ScheduledChunk
from forklift.cpu import cpu_flags
from forklift.model.llama import LayerCache, LlamaForCausalLM
from forklift.model.native_binding import (
    DENSE_STEP_MAX_ROWS,
    SPLIT_STEP_MAX_ROWS,
    StepBinding,
    dense_tile_bytes,
    unsupported_reason,
)
from forklift.model.quantize import QuantizationPlan, QuantizationReport, drop_dense_copies
from forklift.native.build import DISABLE_ENV
from forklift.native.decode_step import NativeDecodeStep
from forklift.native.dense_weights import DenseMatmulKernel
from forklift.native.quant_matmul import QuantMatmulKernel
from forklift.runner.memory import trim_heap
from forklift.runner.prompt_scores import PromptScores, score_prompt_rows
from forklift.runner.step_inputs import StepInputs

logger = logging.getLogger("forklift")


class StepBackend:
    """The block kernels load first (the model is built on them), the native step once the
    model is built (whether it binds depends on the model). `native_step` may be set to None
    later: every answer here then falls back to the PyTorch layers."""

    def __init__(
        self,
        decode_backend: str,
        quantization: QuantizationPlan,
        device: torch.device,
        batch_invariant: bool,
    ) -> None:
        self.decode_backend = decode_backend
        self.quantization = quantization
        self.device = device
        self.batch_invariant = batch_invariant
        self.quant_kernel = self._load_quant_kernel()
        self.native_step: NativeDecodeStep | None = None  # see load_native_step
        # The dense matmul alone, for prompt rows on the dense head tiles (see forward).
        self._dense_kernel: DenseMatmulKernel | None = None
        self.binding: StepBinding | None = None  # bound with the KV cache (see bind)
        # Dense tiles' buffer carried from a binding to the next across weight updates.
        self._dense_buffer: torch.Tensor | None = None
        self.native_steps = 0  # steps the native step ran (tests and benchmarks read it)

    @property
    def decode_path(self) -> str:
        """What runs a small decode step: "native step" (one call), "native matmuls" (the
        PyTorch layers on the native block kernels) or "torch"."""
        if self.native_step is not None:
            return "native step"
        return "native matmuls" if self.quant_kernel is not None else "torch"

    @property
    def dense_step(self) -> bool:
        """The native step runs dense bf16 tiles (it loads on block weights only where the
        block kernels do)."""
        return self.native_step is not None and self.quant_kernel is None

    @property
    def one_forward(self) -> bool:
        """The native step runs every step, on the model's block weights or its dense bf16
        tiles (one arithmetic whatever the step holds)."""
        return self.native_step is not None and self.batch_invariant

    @property
    def native_step_max_rows(self) -> int | None:
        """Most rows a native step runs: 0 without one, None (any) with one forward, else
        the decode steps' limit (dense tiles', or block weights' beside dense copies)."""
        if self.native_step is None:
            return 0
        if self.one_forward:
            return None
        return DENSE_STEP_MAX_ROWS if self.dense_step else SPLIT_STEP_MAX_ROWS

    def runs_native_step(self, scheduled: list[ScheduledChunk]) -> bool:
        """With one forward, every step (one arithmetic whatever the step holds); else a
        decode step of few rows, each sampling its one new token."""
        if self.native_step is None or not scheduled:
            return False
        if self.one_forward:
            return True
        limit = self.native_step_max_rows
        return (
            limit is not None
            and len(scheduled) <= limit
            and all(s.num_new_tokens == 1 and s.samples and not s.scores_prompt for s in scheduled)
        )

    def dense_tile_bytes(self, model: LlamaForCausalLM) -> int:
        """The native step's packed copy of dense bf16 weights (the weights' size again)."""
        return dense_tile_bytes(model) if self.dense_step else 0

    def drop_dense_copies(
        self, model: LlamaForCausalLM, report: QuantizationReport, embedding_updated: bool
    ) -> None:
        """Where the native step runs every step on the blocks, the dense copies of block
        weights serve nothing: release them (the memory plan then counts the blocks). A dense
        model's weights are its own (the tiles are packed from them at every update)."""
        if not self.one_forward or self.dense_step:
            return
        # The tied head's blocks hold the file's embedding exactly until an update changes
        # it (then the head is a rounding of the new embedding, which stays dense).
        tied = ("lm_head (tied)", "gguf blocks")
        exact = tied in [(t.name, t.source) for t in report.tensors]
        drop_dense_copies(model, embedding_in_head=exact and not embedding_updated)
        report.dense_bytes = 0
        trim_heap()

    def bind(self, model: LlamaForCausalLM, layer_caches: list[LayerCache]) -> None:
        """Bind the native step to the weights and the cache now (dense weights are packed
        here), not in the first request."""
        if self.native_step is not None and self.binding is None:
            self.binding = StepBinding(model, layer_caches, self._dense_buffer)
            self._dense_buffer = None  # the binding holds it now

    def unbind(self) -> None:
        """The binding points into the old weights or cache; its dense tiles (no cache
        pointers) are kept for the next binding to pack into."""
        if self.binding is not None:
            self._dense_buffer = self.binding.dense_buffer
        self.binding = None

    def drop_tiles(self) -> None:
        """The tiles copy the weights: released with them."""
        self._dense_buffer = None

    def forward(
        self,
        model: LlamaForCausalLM,
        layer_caches: list[LayerCache],
        inputs: StepInputs,
        row_lora: torch.Tensor | None,
        keep_hidden: bool = False,
    ) -> tuple[torch.Tensor | None, PromptScores | None, torch.Tensor | None]:
        """The native step on a step's inputs: logits of the sampling rows (None if none),
        the asked prompt rows' scores and, with `keep_hidden`, every token's final normed
        hidden state (an MTP drafter reads them). `row_lora`: each token's adapter slot."""
        assert self.native_step is not None and inputs.row_attention is not None
        self.bind(model, layer_caches)  # again after the weights or the cache changed
        assert self.binding is not None
        self.native_steps += 1
        groups = [(g.slot_mapping, g.kv_blocks, g.bias) for g in inputs.row_attention]
        scoring = inputs.prompt_rows is not None and inputs.prompt_targets is not None
        output = self.native_step(
            self.binding, inputs.input_ids, inputs.positions, groups, row_lora,
            logit_rows=inputs.sample_index, keep_hidden=scoring or keep_hidden,
            states=inputs.state_rows,
        )  # fmt: skip
        scores = None
        if scoring:
            assert output.hidden is not None
            scores = score_prompt_rows(
                self._prompt_head(model),
                output.hidden[inputs.prompt_rows],
                inputs.prompt_targets,
                inputs.prompt_top,
            )
        logits = output.logits if inputs.sample_index.numel() else None
        return logits, scores, (output.hidden if keep_hidden else None)

    def _prompt_head(self, model: LlamaForCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
        """What scores prompt rows: on dense tiles the step's own head tiles, each row alone,
        so a prompt row's scores are the sums its sampled logits would be; on block weights
        the model's head, whose blocks serve both."""
        assert self.binding is not None
        tiles, kernel = self.binding.head_tiles, self._dense_kernel
        if tiles is None or kernel is None:
            return model.compute_logits
        return lambda hidden: kernel(hidden, tiles.packed, tiles.n)

    def load_native_step(self, model: LlamaForCausalLM) -> None:
        """One native call per decode step where the model and its weights allow it: block-
        quantized weights, or dense bf16 ones where the CPU has AMX tiles or AVX512-BF16."""
        if self.quant_kernel is None:
            self.native_step = self._load_dense_native_step(model)
            return
        reason = unsupported_reason(model)
        step = NativeDecodeStep.load() if reason is None else None
        if reason is None and step is None:
            reason = "the step library did not build"
        if step is None:
            logger.info("decode step: PyTorch layers with native block matmuls (%s)", reason)
        else:
            if self.batch_invariant:
                logger.info("every step: one native call on the block weights (any rows)")
            else:
                logger.info(
                    "decode step: one native call for up to %d rows; prefill on dense copies "
                    "(batch_invariant off)", SPLIT_STEP_MAX_ROWS,
                )  # fmt: skip
        self.native_step = step

    def _load_dense_native_step(self, model: LlamaForCausalLM) -> NativeDecodeStep | None:
        """The native step on dense bf16 weights: decode_backend auto, no quantization, a
        CPU with AMX-BF16 tiles or AVX512-BF16 dot products; None (the PyTorch layers,
        logged) otherwise."""
        if (
            self.decode_backend != "auto"
            or self.quantization.enabled
            or self.device.type != "cpu"
            or not cpu_flags() & {"amx_bf16", "avx512_bf16"}
        ):
            return None  # the torch path, as the block kernels' log line said
        reason = unsupported_reason(model, dense_tiles=True)
        step = NativeDecodeStep.load() if reason is None else None
        if reason is None and step is None:
            reason = "the step library did not build"
        elif step is not None and not step.dense_tiles:
            reason, step = "no dense kernel in the step library, or no AMX tile state granted", None
        elif step is not None:
            # Built now, not when a request first asks for prompt logprobs (its head tiles).
            self._dense_kernel = DenseMatmulKernel.load()
            if self._dense_kernel is None:
                reason, step = "the dense matmul library did not build", None
        if reason is not None:
            logger.info("decode step: PyTorch layers (dense bf16 native step off: %s)", reason)
            return None
        kernel = "AMX tiles" if "amx_bf16" in cpu_flags() else "AVX512-BF16 dot products"
        if self.batch_invariant:
            logger.info("every step: one native call on dense bf16 weights (%s, any rows)", kernel)
        else:
            logger.info(
                "decode step: one native call on dense bf16 weights (%s) for up to %d rows; "
                "prefill on the PyTorch layers (batch_invariant off)", kernel, DENSE_STEP_MAX_ROWS,
            )  # fmt: skip
        return step

    def _load_quant_kernel(self) -> QuantMatmulKernel | None:
        """The native block kernels where the backend and this machine allow them."""
        decode_backend = self.decode_backend
        if decode_backend == "native" and not self.quantization.enabled:
            raise ValueError(
                "decode_backend='native' runs quantized weights, and this engine's "
                "quantization resolved to 'none'; use 'auto'"
            )
        if decode_backend == "torch" or not self.quantization.enabled:
            return None
        if self.device.type != "cpu":
            if decode_backend == "native":
                raise ValueError("decode_backend='native' runs on a CPU only; use 'auto'")
            return None
        kernel = QuantMatmulKernel.load()
        if kernel is None:
            if decode_backend == "native":
                raise ValueError(
                    "decode_backend='native' needs the native kernels, which did not build "
                    f"here (no C compiler, or {DISABLE_ENV}=0); use 'auto' or 'torch'"
                )
            logger.info("native block kernels unavailable: quantized layers use PyTorch's")
        return kernel
