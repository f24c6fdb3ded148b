"""Rollout sources for GRPO: forklift's engine, or HF `generate()` as the baseline.

Both return, per sample, the completion token ids and the logprob of each sampled token
under the distribution it was drawn from (log_softmax(logits / temperature)), which is what
the trainer's importance ratio compares against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklift.hf_reference import left_padded
from forklift.llm import LLM
from forklift.lora_request import LoRARequest
from forklift.sampling_params import SamplingParams


@dataclass
class Rollout:
    group: int  # index of the prompt this sample answers
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    reward: float = 0.0


def forklift_rollouts(
    llm: LLM,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int,
    lora_request: LoRARequest | None = None,
) -> list[Rollout]:
    """`n` samples per prompt (with `lora_request`'s adapter, if any); each group's prompt
    blocks are computed once and shared."""
    params = [
        SamplingParams(
            n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed + i
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=lora_request,
    )  # fmt: skip
    rollouts = []
    for group, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for sample in output.outputs:
            rollouts.append(
                Rollout(
                    group,
                    prompt,
                    list(sample.token_ids),
                    sample.sampled_logprobs or [],
                    sample.text,
                )  # fmt: skip
            )
    return rollouts


def hf_rollouts(
    model: torch.nn.Module,
    tokenizer,  # noqa: ANN001 - forklift's Tokenizer
    prompts: list[list[int]],
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> list[Rollout]:
    """The same with one static batch of `generate()`, left-padded, pure temperature sampling."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = sorted(tokenizer.eos_token_ids)
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
            top_p=1.0, max_new_tokens=max_tokens, num_return_sequences=n, eos_token_id=eos,
            pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    generated = out.sequences[:, width:]
    logprobs = torch.stack(
        [torch.log_softmax(step.float() / temperature, dim=-1) for step in out.logits], dim=1
    ).gather(2, generated[:, :, None])[:, :, 0]
    rollouts = []
    for row in range(generated.shape[0]):
        tokens = generated[row].tolist()
        length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        group = row // n
        rollouts.append(
            Rollout(
                group,
                prompts[group],
                tokens[:length],
                logprobs[row, :length].tolist(),
                tokenizer.decode(tokens[:length], skip_special_tokens=True),
            )  # fmt: skip
        )
    return rollouts
