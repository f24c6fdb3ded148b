"""The largest step the scheduler can build, run at start-up so its activation peak can be
measured for the memory plan: a full-budget prompt chunk through one layer of each kind,
its logits and the sampler's sorted copies of them."""

from __future__ import annotations

import torch
from torch import nn

from forklift.model.layers.attention import AttentionMetadata
from forklift.model.llama import LayerCache, LlamaForCausalLM


def run_largest_step(
    model: LlamaForCausalLM,
    layer_caches: list[LayerCache],
    meta: AttentionMetadata,
    num_tokens: int,
    max_num_seqs: int,
    device: torch.device,
) -> None:
    """`meta`: one sequence's prompt of `num_tokens` tokens over an allocated cache."""
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device)
    all_layers = model.layers
    chosen = _profiled_layers(all_layers)
    caches = [layer_caches[i] for i in chosen]
    try:
        # A layer's transients are freed before the next layer starts, so the step's
        # peak is that of one layer of each kind: run those (twice, so a handover
        # between layers is in it too), not all of them. A 2048-token fp32 forward
        # through SmolLM2's 30 layers took 8 s of start-up on two cores, and its
        # resident-size peak also counted the profile's own K/V writes to every layer
        # (94 MB): KV memory, budgeted apart.
        model.layers = nn.ModuleList(all_layers[i] for i in chosen)
        with torch.inference_mode():
            hidden = model(ids, positions, caches, meta)
            rows = min(max_num_seqs, num_tokens)
            logits = model.compute_logits(hidden[-rows:])
            # top-k / top-p hold every row sorted (values, int64 order) and its
            # probabilities: their memory, written. (Sorting took 0.7 s of start-up for
            # 256 rows of 49k logits, and its own scratch is no larger than a copy.)
            sampler_rows = (
                torch.zeros_like(logits),
                torch.zeros(logits.shape, dtype=torch.int64),
                torch.zeros_like(logits),
            )
            del sampler_rows
    finally:
        model.layers = all_layers


def _profiled_layers(layers: nn.ModuleList) -> list[int]:
    """Indices of the first layer of each kind (a Llama has one kind, a hybrid model full
    and linear attention), each twice."""
    firsts: dict[tuple[type, bool], int] = {}
    for index, layer in enumerate(layers):
        firsts.setdefault((type(layer), getattr(layer, "is_full_attention", True)), index)
    return [index for index in sorted(firsts.values()) for _ in range(2)]
