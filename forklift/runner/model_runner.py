"""Owns the model and its paged KV cache; turns a scheduled batch into sampled tokens.

The runner drives its parts: the backend (runner/backend.py: which kernels run a step), the
cache tensors (runner/cache_tensors.py), the step inputs (runner/step_inputs.py) and the
model built by model/registry.py. Every call that touches the model is `@mirrored` to the
other tensor-parallel ranks (runner/mirroring.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from forklift.core.scheduler_output import ScheduledChunk
from forklift.model.kv_cache_dtype import kv_cache_format
from forklift.model.kv_layout import kv_layout
from forklift.model.layers.decode_attention import DecodeAttention
from forklift.model.llama import EAGER_REGIONS, LayerCache, LlamaForCausalLM, compiled_regions
from forklift.model.model_config import ModelConfig
from forklift.model.native_binding import native_step_peak_bytes
from forklift.model.quantize import (
    NO_QUANTIZATION,
    QuantizationPlan,
    QuantizationReport,
    materialize_dense,
    quantize_from_file,
    quantize_model,
    requantize,
)
from forklift.model.registry import build_model
from forklift.model.tensor_parallel import TensorParallelShard
from forklift.model.tp_group import TensorParallelGroup
from forklift.model.weight_update import WeightUpdater
from forklift.native.decode_attention_kernel import NativeDecodeAttention
from forklift.native.decode_step import NativeDecodeStep
from forklift.native.quant_matmul import QuantMatmulKernel
from forklift.native.seeded_sample import native_seeded_sampler
from forklift.runner.activation_profile import run_largest_step
from forklift.runner.backend import StepBackend
from forklift.runner.cache_tensors import CacheTensors
from forklift.runner.capture_backends import CudaGraphBackend, backend_for
from forklift.runner.decode_capture import CaptureKey, DecodeCapture, StaticDecodeInputs
from forklift.runner.draft_rows import expand_draft_rows
from forklift.runner.lora_store import LoRALimits, LoRAStore
from forklift.runner.memory import (
    KVCachePlan,
    kv_block_bytes,
    measure_peak_bytes,
    module_bytes,
    plan_kv_cache,
    total_device_memory,
)
from forklift.runner.mirroring import RankMirror, mirrored
from forklift.runner.prompt_scores import PromptScores, score_prompt_rows, split_prompt_scores
from forklift.runner.step_inputs import StepInputBuilder, StepInputs
from forklift.runner.warm_up import warm_up_decode_attention
from forklift.sampling.batch_reuse import SamplingBatchReuse
from forklift.sampling.sampler import SamplerOutput, sample


@dataclass
class StepResult:
    # Index into the scheduled list of each row of `sampler_output` (a chunk with drafts
    # has one row per position, in order).
    sampled_items: list[int]
    sampler_output: SamplerOutput | None
    # (index into the scheduled list, its rows of scores) for chunks scoring their prompt.
    prompt_scores: list[tuple[int, PromptScores]] = field(default_factory=list)
    # Every token's final hidden state, where the runner keeps them (an MTP layer reads them).
    hidden_states: torch.Tensor | None = None


class ModelRunner:
    """One model on one device (one tensor-parallel rank's shard): its weights' life (built,
    freed, reloaded, updated in place), its KV cache's memory plan and allocation, and each
    scheduled step run through the backend's kernels and sampled."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        block_size: int,
        sliding_window: int | None = None,
        enforce_eager: bool = True,
        capture_sizes: tuple[int, ...] = (),
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationPlan = NO_QUANTIZATION,
        decode_backend: str = "auto",
        lora: LoRALimits | None = None,
        batch_invariant: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`weights` yields the full HF-named tensors (called again to reload them). With a
        tensor-parallel group, this runner holds one rank's shard; rank 0's runner drives
        the others, which run every `@mirrored` call it makes (runner/mirroring.py)."""
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        # How the KV cache holds K/V: in `dtype`, or int8 rows with a scale each.
        self.kv_format = kv_cache_format(kv_cache_dtype, dtype)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.kv_layout = kv_layout(model_config)
        self.weights = weights
        self.quantization = quantization
        self.quantization_report = QuantizationReport(quantization.method)
        self.batch_invariant = batch_invariant
        # An update changed a tied embedding (see StepBackend.drop_dense_copies).
        self._embedding_updated = False
        self.backend = StepBackend(decode_backend, quantization, device, batch_invariant)
        self.tp = tp
        self.mirror = RankMirror(tp)
        self.shard = (
            None if tp is None else TensorParallelShard.plan(model_config, tp.rank, tp.world_size)
        )
        self.lora: LoRAStore | None = None
        self.model = self._build_model()
        if lora is not None:
            self.lora = LoRAStore(self.model, self.model.config, lora, device)
        self.backend.load_native_step(self.model)
        self._drop_dense_copies()
        if self.device.type == "cpu":
            native_seeded_sampler()  # the sampler's kernel: built now, not mid-request
        # Speculation by MTP reads every token's final hidden state (StepResult's).
        self.keep_hidden_states = False
        self._weight_updater = WeightUpdater(self.model)
        self.cache = CacheTensors(self.kv_layout, self.kv_format, block_size, dtype, device)
        self._sampling_batches = SamplingBatchReuse()
        self.decode_capture: DecodeCapture | None = None
        if not enforce_eager:
            recorder = backend_for(device)
            # CUDA graphs record the eager kernels; a CPU compiles the layers' dense regions.
            self._captured_regions = (
                EAGER_REGIONS if isinstance(recorder, CudaGraphBackend) else compiled_regions()
            )
            self.decode_capture = DecodeCapture(
                recorder, self._captured_forward, capture_sizes, max_model_len
            )
        self.input_builder = StepInputBuilder(
            self.model.config, self.kv_layout, block_size=block_size,
            sliding_window=sliding_window, device=device, cache=self.cache,
            capture=self.decode_capture,
        )  # fmt: skip

    # ---- memory -------------------------------------------------------------------------
    def plan_kv_cache(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        kv_cache_memory_bytes: int | None,
        memory_utilization: float,
        num_blocks_override: int | None = None,
        extra_weight_bytes: int = 0,
        extra_block_bytes: int = 0,
        state_checkpoints: bool = False,
        max_model_len: int = 0,
    ) -> KVCachePlan:
        """Blocks for the budget; a speculation drafter's weights and its K/V in every block
        (`extra_*`) come out of the same budget, as do a hybrid model's state checkpoints."""
        peak = 0
        if kv_cache_memory_bytes is None and num_blocks_override is None:
            if self.one_forward:
                # Its scratch is a formula of the rows (a full-budget step would cost
                # seconds of start-up to measure).
                peak = native_step_peak_bytes(
                    self.model.config, max_num_batched_tokens, max_num_seqs,
                    self.max_model_len, self.block_size, len(self.kv_layout.windows),
                    dense=self.backend.dense_step,
                )  # fmt: skip
            else:
                peak = measure_peak_bytes(
                    lambda: self._profile_forward(max_num_batched_tokens, max_num_seqs),
                    self.device,
                )
        return plan_kv_cache(
            model_config=self.model.config,  # this rank's KV heads
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_format=self.kv_format,
            num_blocks_override=num_blocks_override,
            memory_utilization=memory_utilization,
            total_memory=self._memory_share(),
            weight_bytes=self.weight_bytes + extra_weight_bytes,
            activation_peak_bytes=peak,
            max_num_seqs=max_num_seqs,
            max_chunk=max_num_batched_tokens,
            extra_bytes_per_block=extra_block_bytes,
            state_checkpoints=state_checkpoints,
            max_model_len=max_model_len,
        )

    @property
    def weight_bytes(self) -> int:
        return (module_bytes(self.model) + self.model.packed_bytes() + self._lora_bytes
                + self.backend.dense_tile_bytes(self.model))  # fmt: skip

    @property
    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.model.config, self.kv_format, self.block_size)

    @property
    def _lora_bytes(self) -> int:
        """The adapter slots: allocated before the KV cache is sized."""
        return 0 if self.lora is None else self.lora.nbytes

    def _memory_share(self) -> int:
        """The memory this rank may plan with: tensor-parallel ranks on a CPU share its RAM."""
        total = total_device_memory(self.device)
        if self.tp is not None and self.device.type == "cpu":
            return total // self.tp.world_size
        return total

    # ---- the backend (runner/backend.py), as callers and tests read it ------------------
    @property
    def quant_kernel(self) -> QuantMatmulKernel | None:
        return self.backend.quant_kernel

    @property
    def native_step(self) -> NativeDecodeStep | None:
        return self.backend.native_step

    @native_step.setter
    def native_step(self, step: NativeDecodeStep | None) -> None:
        self.backend.native_step = step  # None: the PyTorch layers from the next step on

    @property
    def native_steps(self) -> int:
        return self.backend.native_steps

    @property
    def one_forward(self) -> bool:
        return self.backend.one_forward

    @property
    def native_step_max_rows(self) -> int | None:
        return self.backend.native_step_max_rows

    @property
    def decode_path(self) -> str:
        return self.backend.decode_path

    # ---- the model and its cache --------------------------------------------------------
    def _build_model(self) -> LlamaForCausalLM:
        # One forward keeps no dense copy of a weight the file's blocks serve: those never
        # load dense (a 3B Q4_K_M file peaked at 20.6 GiB when they did).
        from_blocks = None
        if self.batch_invariant and self.quant_kernel is not None and self.shard is None:
            from_blocks = partial(quantize_from_file, plan=self.quantization,
                                  kernel=self.quant_kernel)  # fmt: skip
        model = build_model(
            self.model_config, self.weights, self.device, self.dtype, self.max_model_len,
            self.shard, from_blocks,
        )  # fmt: skip
        model.set_tensor_parallel_group(self.tp)
        native = NativeDecodeAttention.load() if self.device.type == "cpu" else None
        model.use_decode_attention(DecodeAttention(self.device, native))
        self.quantization_report = quantize_model(model, self.quantization, self.quant_kernel)
        if self.lora is not None:  # a rebuilt model keeps the adapters' slots
            self.lora.attach(model)
        return model

    def _drop_dense_copies(self) -> None:
        self.backend.drop_dense_copies(
            self.model, self.quantization_report, self._embedding_updated
        )

    def shutdown(self) -> None:
        """Release the other tensor-parallel ranks: their serving loops end."""
        self.mirror.stop()

    @mirrored
    def _profile_forward(self, num_tokens: int, max_num_seqs: int) -> None:
        """The largest step the scheduler can build: one full-budget prefill chunk, plus logits
        and the sampler's sorted copy of them for up to max_num_seqs rows."""
        num_tokens = min(num_tokens, self.max_model_len)
        blocks = -(-num_tokens // self.block_size) + 1
        self._allocate_kv_cache(blocks, 1)
        table = np.arange(1, blocks, dtype=np.int64)[None, :]
        # Every KV group writes the same blocks: this is a profile.
        tables = [table] * len(self.kv_layout.windows)
        builder = self.input_builder
        meta, _ = builder.attention_metadata(np.array([0]), np.array([num_tokens]), tables)
        meta.linear = builder.linear_metadata(np.array([0]), np.array([num_tokens]), np.array([1]))
        run_largest_step(self.model, self.layer_caches, meta, num_tokens, max_num_seqs, self.device)
        self._free_kv_cache()

    @mirrored
    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self._allocate_kv_cache(num_blocks, num_state_slots)
        warm_up_decode_attention(
            self.model, self.layer_caches, self.block_size, self.dtype, self.device
        )
        self.backend.bind(self.model, self.layer_caches)  # the new cache, not the first request's

    def _allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self.cache.allocate(self.model.config, num_blocks, num_state_slots)  # this rank's heads
        self._reset_captures()  # captures hold the old cache's addresses

    @property
    def layer_caches(self) -> list[LayerCache]:
        """What the model reads, one entry per layer (empty while no cache is allocated)."""
        return self.cache.layer_caches

    @property
    def kv_cache_bytes(self) -> int:
        """The KV blocks and, for a hybrid model, its state slots."""
        return self.cache.nbytes

    @mirrored
    def free_kv_cache(self) -> None:
        self._free_kv_cache()

    def _free_kv_cache(self) -> None:
        self.cache.free()
        self._reset_captures()

    def _reset_captures(self) -> None:
        self.backend.unbind()  # the binding points into the old weights or cache
        if self.decode_capture is not None:
            self.decode_capture.reset()

    @mirrored
    def free_weights(self) -> None:
        """Release every parameter's storage; `reload_weights` brings them back."""
        self._weight_updater.discard()
        self.model.unpack_weights()
        self._reset_captures()
        self.backend.drop_tiles()
        with torch.no_grad():
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @mirrored
    def reload_weights(self) -> None:
        """Rebuild the model from the original weights."""
        self.model = self._build_model()
        self._embedding_updated = False
        self._drop_dense_copies()
        self._weight_updater = WeightUpdater(self.model)
        self._reset_captures()  # captures hold the old parameters' addresses

    # ---- weight updates -----------------------------------------------------------------
    @mirrored(rank0_first=True)
    def stage_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Check and stage full HF tensors (see WeightUpdater). Rank 0 checks them before
        any other rank sees them, so a bad update fails on every rank or on none."""
        return self._weight_updater.stage(named_tensors)

    @mirrored
    def commit_weights(self) -> int:
        updater = self._weight_updater
        changed = updater.staged_params
        # Dropped dense weights come back for the update (from their blocks where it keeps
        # some rows), and go again once re-quantized, before anything packs them.
        materialize_dense(self.model, changed, updater.partly_staged_params)
        self._embedding_updated |= "embed_tokens.weight" in changed
        applied = updater.commit()
        # The packed and quantized copies derive from the weights.
        requantize(self.model, changed, self.quant_kernel)
        self._drop_dense_copies()
        self.model.pack_weights()
        self._reset_captures()  # requantized layers are new tensors
        if self.layer_caches:  # bind (and pack dense tiles) in the update, not the next step
            self.backend.bind(self.model, self.layer_caches)
        return applied

    @property
    def num_staged_weights(self) -> int:
        return self._weight_updater.num_staged

    # ---- one step -----------------------------------------------------------------------
    def execute(
        self,
        scheduled: list[ScheduledChunk],
        state_copies: Sequence[tuple[int, int]] = (),
        lora_loads: Sequence[tuple[int, int]] = (),
        block_copies: Sequence[tuple[int, int]] = (),
    ) -> StepResult:
        rows, chunk_of = expand_draft_rows(scheduled)
        if self.lora is not None:
            self.lora.load(lora_loads)
            self.lora.begin_step(rows)
        try:
            return self._execute(rows, chunk_of, state_copies, block_copies)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _execute(
        self,
        rows: list[ScheduledChunk],
        chunk_of: list[int],
        state_copies: Sequence[tuple[int, int]],
        block_copies: Sequence[tuple[int, int]],
    ) -> StepResult:
        native = self.backend.runs_native_step(rows)
        key = None if native else self.input_builder.capture_key(rows)
        pad_to = key.batch if key is not None else None
        kv_width = key.kv_width if key is not None else 0
        inputs = self.input_builder.prepare(
            rows,
            pad_to=pad_to,
            kv_width=kv_width,
            state_copies=state_copies,
            block_copies=block_copies,
            native=native,
        )
        sampled_items = [chunk_of[i] for i, row in enumerate(rows) if row.samples]
        logits, scores, hidden = self.forward_step(inputs, key, native)
        prompt_scores = []
        if scores is not None:
            prompt_scores = [(chunk_of[i], s) for i, s in split_prompt_scores(rows, scores)]
        if logits is None:
            return StepResult([], None, prompt_scores, hidden)
        with torch.inference_mode():
            sampling = [row for item in rows if (row := item.sampling) is not None]
            batch = self._sampling_batches.batch_for(sampling, self.device, logits.shape[1])
            return StepResult(sampled_items, sample(logits, batch), prompt_scores, hidden)

    @mirrored
    def forward_step(
        self, inputs: StepInputs, key: CaptureKey | None = None, native: bool = False
    ) -> tuple[torch.Tensor | None, PromptScores | None, torch.Tensor | None]:
        """The model on one step's inputs: logits of the sampling rows (None if none), the
        scores of the prompt rows asked for (None if none), and every token's final hidden
        state where `keep_hidden_states` (else None). `native`: a decode step the native
        step runs whole (see `StepBackend.runs_native_step`)."""
        with torch.inference_mode():
            self.cache.write_before_step(
                inputs.fresh_blocks, inputs.state_copies, inputs.block_copies
            )
            if native:
                rows = self.lora.context.rows if self.lora is not None else None
                row_lora = rows.token_slots if rows is not None else None
                logits, scores, hidden = self.backend.forward(
                    self.model, self.layer_caches, inputs, row_lora, self.keep_hidden_states
                )
                return logits, scores, None if hidden is None else hidden.to(self.dtype)
            if key is not None and self.decode_capture is not None:
                hidden = self.decode_capture.run(
                    key, inputs.input_ids, inputs.positions, inputs.meta
                )
            else:
                hidden = self.model(
                    inputs.input_ids, inputs.positions, self.layer_caches, inputs.meta
                )
            kept = hidden if self.keep_hidden_states else None
            scores = None
            if inputs.prompt_rows is not None and inputs.prompt_targets is not None:
                scores = score_prompt_rows(
                    self.model.compute_logits,
                    hidden[inputs.prompt_rows],
                    inputs.prompt_targets,
                    inputs.prompt_top,
                )
            if inputs.sample_index.numel() == 0:
                return None, scores, kept
            return self.model.compute_logits(hidden[inputs.sample_index]), scores, kept

    def _captured_forward(self, static: StaticDecodeInputs) -> torch.Tensor:
        return self.model(
            static.input_ids,
            static.positions,
            self.layer_caches,
            static.meta,
            self._captured_regions,
        )
