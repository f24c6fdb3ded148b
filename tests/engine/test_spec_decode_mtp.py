"""Speculation with Qwen3.5's multi-token prediction layer: its guesses are those of a
plain HF-transformers layer run over the whole sequence, and outputs are those of decoding
without speculation, token for token, through chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode_engine import abort_every_other, assert_same, prompts_of, run
from test_spec_decode_hybrid import assert_nothing_held, hybrid_llm
from tiny_models import add_mtp_layer, make_tiny_hybrid, make_tiny_model
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from forklift import SamplingParams
from forklift.core.state_checkpoints import StateCheckpoints

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive_draft_length": False}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    tiny = make_tiny_hybrid("interval", tmp_path_factory.mktemp("hybrid-mtp"))
    return tiny, add_mtp_layer(tiny)


def reference_first_guess(target, mtp: dict[str, torch.Tensor], tokens: list[int]):
    """HF's own layer as the MTP layer over the whole sequence: the normed output at the
    last position (from the target's hidden state at the newest computed token and the
    newest token)."""
    config = target.config
    one_layer = hf.Qwen3_5TextConfig(**{**config.to_dict(), "num_hidden_layers": 1,
                                        "layer_types": ["full_attention"]})  # fmt: skip
    layer = hf.Qwen3_5TextModel(one_layer).float().eval()
    state = {name[len("mtp.") :]: t for name, t in mtp.items() if name.startswith("mtp.layers.")}
    state["norm.weight"] = mtp["mtp.norm.weight"]
    state["embed_tokens.weight"] = target.model.embed_tokens.weight
    layer.load_state_dict(state, strict=False)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norms[name] = hf.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[f"mtp.{name}.weight"])
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = target.model(ids[:, :-1]).last_hidden_state  # positions 0 .. n - 2
        embedded = target.model.embed_tokens(ids[:, 1:])  # the token after each
        x = torch.cat([norms["pre_fc_norm_embedding"](embedded),
                       norms["pre_fc_norm_hidden"](hidden)], -1)  # fmt: skip
        x = x @ mtp["mtp.fc.weight"].t()
        return layer(inputs_embeds=x).last_hidden_state[0, -1]


def test_mtp_guesses_what_the_layer_computes_over_the_whole_sequence(mtp_model):
    tiny, mtp = mtp_model
    # No prefix cache: its checkpoints would stop the prompt short of its end.
    llm = hybrid_llm(tiny.path, speculative_config=MTP, enable_prefix_caching=False)
    proposer = llm.llm_engine.proposer
    seen = []
    forward = proposer._forward

    def recording(chunks, hidden, logit_rows):
        out, logits = forward(chunks, hidden, logit_rows)
        if chunks[0].num_new_tokens > 1:  # a catch-up over a whole prompt
            seen.append((list(chunks[0].token_ids), out[-1].clone()))
        return out, logits

    proposer._forward = recording
    for prompt in prompts_of(3, seed=1):
        seen.clear()
        output = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
        tokens, guessed = seen[0]
        assert tokens == prompt[1:] + [output.token_ids[0]]
        expected = reference_first_guess(tiny.hf_model, mtp, prompt + [output.token_ids[0]])
        assert torch.allclose(guessed, expected, atol=1e-4)


def test_the_mtp_layer_runs_natively_beside_a_dense_bf16_target(mtp_model):
    """On AMX the bf16 target runs the native step on dense tiles, and the MTP layer runs
    beside it in one call a round: each call's outputs are the PyTorch layer's on the same
    cache to bf16 rounding, with the same guesses almost always. (A dense target runs rows
    verifying drafts on its PyTorch layers, so its tokens may differ from decoding without
    speculation in the last bits; the block-weight targets above hold them equal.)"""
    tiny, _ = mtp_model
    kwargs = dict(dtype="bfloat16", enable_prefix_caching=False)
    llm = hybrid_llm(tiny.path, speculative_config=MTP, **kwargs)
    if not llm.llm_engine.runner.backend.dense_step:
        pytest.skip("no dense bf16 native step on this CPU (AMX)")
    proposer = llm.llm_engine.proposer
    forward, native_binding = proposer._forward, proposer._native_binding
    deviations, agreements, native_calls = [], [], 0

    def compared(chunks, hidden, logit_rows):
        nonlocal native_calls
        saved = [t.clone() for t in proposer.cache]
        proposer._native_binding = lambda: None
        want, want_logits = forward(chunks, hidden, logit_rows)
        proposer._native_binding = native_binding
        for tensor, before in zip(proposer.cache, saved, strict=True):
            tensor.copy_(before)
        native_calls += native_binding() is not None
        out, logits = forward(chunks, hidden, logit_rows)
        deviations.append(float((out.float() - want.float()).abs().max()))
        agreements.extend((logits.argmax(-1) == want_logits.argmax(-1)).tolist())
        return out, logits

    proposer._forward = compared
    got = run(llm, prompts_of(4, seed=5), GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in got)
    assert native_calls == len(deviations) > 0
    assert max(deviations) < 0.1, deviations
    assert sum(agreements) >= 0.9 * len(agreements)
    assert_nothing_held(llm)


def test_mtp_drafts_for_sequences_resumed_from_the_prefix_cache(mtp_model):
    tiny, _ = mtp_model
    prompts = prompts_of(4, seed=3)
    expected = run(hybrid_llm(tiny.path), prompts, GREEDY)
    llm = hybrid_llm(tiny.path, speculative_config=MTP)
    kv = llm.llm_engine.kv_manager  # checkpoints at these short prompts' ends too
    kv.state_checkpoints = StateCheckpoints(kv.state_checkpoints.slots, kv.block_size, 1024, 0)
    run(llm, prompts, GREEDY)
    before = llm.llm_engine.spec_stats.num_draft_tokens
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(output.num_cached_tokens > 0 for output in again)
    assert_same(again, expected)
    assert llm.llm_engine.spec_stats.num_draft_tokens > before
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "situation",
    [{}, dict(num_gpu_blocks_override=40), dict(max_num_batched_tokens=8)],
    ids=["plain", "preemption", "chunked-prefill"],
)
def test_mtp_drafts_change_no_token(mtp_model, situation):
    tiny, _ = mtp_model
    prompts = prompts_of(6, seed=2)
    expected = run(hybrid_llm(tiny.path), prompts, GREEDY)
    llm = hybrid_llm(tiny.path, speculative_config=MTP, **situation)
    assert_same(run(llm, prompts, GREEDY), expected)
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0
    if situation.get("num_gpu_blocks_override"):
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_nothing_held(llm)
    assert llm.llm_engine.proposer._progress == {}


def test_mtp_is_refused_without_its_layer(tmp_path):
    make_tiny_hybrid("interval", tmp_path / "hybrid")
    with pytest.raises(ValueError, match="no multi-token prediction"):
        hybrid_llm(tmp_path / "hybrid", speculative_config=MTP)
    make_tiny_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="mtp.*Qwen3.5"):
        hybrid_llm(tmp_path / "llama", speculative_config=MTP)


def test_mtp_with_seeded_samples_forks_and_aborts(mtp_model):
    tiny, _ = mtp_model
    prompts = [p * 3 for p in prompts_of(2, seed=5)]
    params = SamplingParams(n=3, temperature=0.8, max_tokens=20, ignore_eos=True, seed=9)
    expected = run(hybrid_llm(tiny.path), prompts, params)
    llm = hybrid_llm(tiny.path, speculative_config=MTP)
    drafted = set()
    propose = llm.llm_engine.proposer.propose_batch

    def recording(queries):
        proposals = propose(queries)
        drafted.update(q.request_id for q, d in zip(queries, proposals, strict=True) if d)
        return proposals

    llm.llm_engine.proposer.propose_batch = recording
    assert_same(run(llm, prompts, params), expected)
    assert len(drafted) == 6  # every sample, those forked from a leader's prompt too
    engine = llm.llm_engine
    abort_every_other(llm, prompts_of(4, 7), GREEDY, steps=5)
    assert engine.spec_stats.num_draft_tokens > 0
    assert_nothing_held(llm)
    assert engine.proposer._progress == {}
