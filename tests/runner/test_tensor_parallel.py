"""Tensor parallelism: shard arithmetic, and TP=2 (two processes, gloo) == TP=1 token for token."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from tiny_models import ARCHITECTURES, SMOLLM2_LIKE, VOCAB, make_tiny_model

from forklift import LLM, SamplingParams
from forklift.model.tensor_parallel import TensorParallelShard, split_range
from forklift.model.tp_group import check_single_node
from forklift.model.weight_slots import hf_tensor_shape


def test_split_range_covers_everything_once():
    for total, parts in ((3, 2), (9, 4), (1536, 2), (7, 7)):
        ranges = [split_range(total, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


def test_gqa_groups_stay_whole_when_heads_do_not_divide():
    first, second = (TensorParallelShard.plan(SMOLLM2_LIKE, r, 2) for r in (0, 1))
    assert (first.kv_heads, first.q_heads) == ((0, 2), (0, 6))
    assert (second.kv_heads, second.q_heads) == ((2, 3), (6, 9))
    # The vocabulary is padded to a multiple of the ranks so gathered logits line up.
    assert first.vocab == (0, 24577) and second.vocab == (24577, 49154)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
    ],
)
def test_shards_reassemble_the_full_tensor(name):
    full = torch.randn(hf_tensor_shape(name, SMOLLM2_LIKE))
    shards = [TensorParallelShard.plan(SMOLLM2_LIKE, r, 2).shard(name, full, SMOLLM2_LIKE)
              for r in (0, 1)]  # fmt: skip
    if full.dim() == 1:  # norms are replicated
        assert all(torch.equal(s, full) for s in shards)
        return
    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
    joined = torch.cat(shards, dim=dim)
    assert torch.equal(joined[: full.shape[0]], full)
    assert not joined[full.shape[0] :].any()  # vocabulary padding rows are zeros


def test_more_ranks_than_kv_heads_is_a_clear_error(tmp_path):
    make_tiny_model("llama", tmp_path)  # 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds the model's 2 KV heads"):
        LLM(model=str(tmp_path), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(tmp_path), tensor_parallel_size=0)


def test_a_group_across_machines_is_refused_or_loudly_allowed(caplog):
    check_single_node(["node-a", "node-a"], allow_cross_node=False)
    with pytest.raises(ValueError, match="spans machines"):
        check_single_node(["node-a", "node-b"], allow_cross_node=False)
    with caplog.at_level(logging.WARNING, logger="forklift"):
        check_single_node(["node-a", "node-b"], allow_cross_node=True)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "spans machines" in caplog.text


def _tiny_llm(path, tp: int) -> LLM:
    return LLM(
        model=str(path), dtype="float32", max_model_len=256, block_size=4,
        kv_cache_memory_bytes=2**20, max_num_batched_tokens=64, tensor_parallel_size=tp,
    )  # fmt: skip


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 30)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tp2_gives_the_tp1_tokens_on_tiny_models(arch, tmp_path):
    make_tiny_model(arch, tmp_path)
    prompts = _prompts(len(arch))
    expected = _greedy(_tiny_llm(tmp_path, 1), prompts)
    llm = _tiny_llm(tmp_path, 2)
    try:
        assert _greedy(llm, prompts) == expected
    finally:
        llm.shutdown()


def _perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, p.detach() + 0.05 * torch.randn(p.shape, generator=generator))
        for name, p in model.state_dict().items()
    ]


@pytest.mark.slow
def test_tp2_weight_updates_match_tp1(tmp_path):
    tiny = make_tiny_model("qwen2", tmp_path)  # biases and tied embeddings get sharded too
    prompts = _prompts(5)
    single, pair = _tiny_llm(tmp_path, 1), _tiny_llm(tmp_path, 2)
    try:
        before = _greedy(pair, prompts)
        update = _perturbed(tiny.hf_model, seed=3)
        single.update_weights(update)
        pair.update_weights(update)
        after = _greedy(pair, prompts)
        assert after == _greedy(single, prompts) and after != before
        # A bad update is refused on rank 0 before any other rank sees it: all stay whole.
        bad = [update[0], ("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))]
        with pytest.raises(ValueError, match="down_proj"):
            pair.update_weights(bad)
        assert pair.llm_engine.num_staged_weights == 0
        assert _greedy(pair, prompts) == after
    finally:
        pair.shutdown()


@pytest.mark.slow
def test_tp2_on_the_default_model(default_source, default_llm_fp32):
    tokenizer = default_llm_fp32.get_tokenizer()
    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("def fibonacci(n):"),
    ]
    expected = _greedy(default_llm_fp32, prompts, tokens=16)
    llm = LLM(
        model=str(default_source.path), dtype="float32", max_model_len=512,
        kv_cache_memory_bytes=64 * 2**20, max_num_batched_tokens=512, tensor_parallel_size=2,
    )  # fmt: skip
    try:
        assert _greedy(llm, prompts, tokens=16) == expected
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp2_sizes_its_kv_cache_by_profiling(tmp_path):
    """Without an explicit KV size every rank runs the profiling forward together."""
    make_tiny_model("llama", tmp_path)
    prompts = _prompts(11)
    expected = _greedy(_tiny_llm(tmp_path, 1), prompts)
    llm = LLM(
        model=str(tmp_path), dtype="float32", max_model_len=256, block_size=4,
        max_num_batched_tokens=64, gpu_memory_utilization=0.01, tensor_parallel_size=2,
    )  # fmt: skip
    try:
        assert llm.llm_engine.num_usable_blocks > 1000
        assert _greedy(llm, prompts) == expected
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_script_without_the_main_guard_fails_fast_and_says_so(tmp_path):
    """Spawned ranks re-import the main script; without the guard they die at import, and
    rank 0 must say so at once rather than wait out the group's timeout."""
    import subprocess
    import sys
    import textwrap
    import time

    make_tiny_model("llama", tmp_path)
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from forklift import LLM
            LLM(model={str(tmp_path)!r}, dtype="float32", tensor_parallel_size=2,
                kv_cache_memory_bytes=2**20, max_model_len=64)
            """
        )
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode != 0
    assert "tensor-parallel rank 1 exited with code 1" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_a_rank_killed_mid_run_makes_rank_0_raise_with_its_exit_code(tmp_path):
    import os
    import signal

    make_tiny_model("llama", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=2,
              kv_cache_memory_bytes=2**20, max_model_len=64)  # fmt: skip
    worker = llm.llm_engine._tp_workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
