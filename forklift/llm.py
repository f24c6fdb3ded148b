"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from forklift.config import EngineConfig
from forklift.core.input_processor import PromptType
from forklift.engine.engine import LLMEngine
from forklift.lora_request import LoRARequest
from forklift.outputs import RequestOutput
from forklift.sampling_params import SamplingParams
from forklift.tokenizer import Tokenizer

T = TypeVar("T")
Conversation = list[dict[str, Any]]


class LLM:
    """Generate for many prompts at once with continuous batching.

    `LLM(model=None)` loads the default model; every other keyword is an `EngineConfig` field
    (unknown ones raise ValueError).
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype, **kwargs))

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, with transformers' methods (None: prompts must be ids)."""
        return self.llm_engine.tokenizer

    # ---- RL: weights in, memory out (see the LLMEngine methods of the same names) ----------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], finalize: bool = True
    ) -> int:
        return self.llm_engine.update_weights(named_tensors, finalize)

    @property
    def weight_version(self) -> int:
        return self.llm_engine.weight_version

    def sleep(self, level: int = 1) -> None:
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        self.llm_engine.wake_up()

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes; the LLM is unusable afterwards."""
        self.llm_engine.shutdown()

    # ---- LoRA adapters (see the LLMEngine methods of the same names) ----------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, adapter: str | int) -> LoRARequest:
        return self.llm_engine.remove_lora(adapter)

    def list_loras(self) -> list[Any]:
        return self.llm_engine.list_loras()

    def update_lora(self, adapter: str | int, tensors: dict[str, torch.Tensor]) -> int:
        return self.llm_engine.update_lora(adapter, tensors)

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (see `LLMEngine.reset_prefix_cache`)."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, loras)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`tools` (OpenAI function tools) go to the chat template, as HF passes them; hold
        a call to a schema with `SamplingParams.structured_outputs`."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        conversations = _as_conversation_list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            ids = tokenizer.encode_chat(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": ids})
        params_list = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        outputs = self._run(prompts, params_list, use_tqdm, loras)
        for output, conversation in zip(outputs, conversations, strict=True):
            output.prompt = tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
            output.extra["messages"] = conversation
        return outputs

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Tokenize and validate every prompt before queueing any, so a bad one costs no work.
        processed = [
            engine.input_processor.process(prompt, p)
            for prompt, p in zip(prompts, params, strict=True)
        ]
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            engine.add_lora(lora)  # a bad adapter fails before anything is queued
        ids = [
            engine.add_processed(None, prompt, lora_request=lora)
            for prompt, lora in zip(processed, loras, strict=True)
        ]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        start, generated = time.perf_counter(), 0
        try:
            while any(r is None for r in results):
                for output in engine.step(finished_only=True):
                    if output.request_id in order:
                        results[order[output.request_id]] = output
                        generated += sum(len(o.token_ids) for o in output.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request([rid for rid, r in zip(ids, results, strict=True) if r is None])
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    return _one_per_prompt(lora_request, count, "lora_request")


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(
        f"prompt must be a string, a list of token ids, or a list of those; got {prompts!r}"
    )


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    return _one_per_prompt(params, count, "sampling_params")


def _one_per_prompt(values: Sequence[T], count: int, name: str) -> list[T]:
    """A per-prompt list of `count` entries, or a ValueError naming the field."""
    values = list(values)
    if len(values) != count:
        raise ValueError(
            f"got {len(values)} {name} for {count} prompts; give one or one per prompt"
        )
    return values


def _as_conversation_list(
    messages: Conversation | Sequence[Conversation],
) -> list[Conversation]:
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]  # type: ignore[arg-type]
    return [list(c) for c in messages]  # type: ignore[arg-type]
