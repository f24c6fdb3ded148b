"""The native step on Qwen3.5 hybrids (csrc/gated_deltanet.h beside gated attention): on
block weights every step runs it, its tokens are the PyTorch layers' (the chunked and
recurrent delta rule on the same block matmuls, logprobs within rounding), and, since every
token runs the recurrent form, a request's tokens and logprobs are bitwise the same alone,
beside others, chunked at any size (across the step's 256-row chunks too), from a state
checkpoint, forked for samples, preempted, or verified among drafts."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from spec_oracles import OracleProposer, sequences
from test_native_dense_step import _bf16_checkpoint, _deviations
from tiny_models import add_mtp_layer, make_tiny_hybrid

from forklift import LLM, SamplingParams
from forklift.core.state_checkpoints import StateCheckpoints
from forklift.model.layers.gated_deltanet import GatedDeltaNet
from forklift.model.model_config import LinearAttentionConfig
from forklift.native import build as native_build
from forklift.native.decode_step import NativeDecodeStep, StepLinearLayer, StepLinearShape
from forklift.runner.linear_metadata import build_linear_metadata, native_state_rows

pytestmark = pytest.mark.skipif(
    native_build.find_compiler() is None, reason="no C compiler on this machine"
)

# The tests' hybrid layouts, with every projection's input a multiple of 32 (int4 blocks).
VARIANTS = {
    "interval": dict(linear_value_head_dim=8),
    "odd-heads": dict(linear_value_head_dim=32, head_dim=32),
    "sandwich": {},
}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=list(VARIANTS))
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"native-{request.param}")
    make_tiny_hybrid(request.param, path, **VARIANTS[request.param])
    return path


def _engine(path, **kwargs) -> LLM:
    common = dict(model=str(path), dtype="float32", quantization="int4", max_model_len=512,
                  block_size=4, kv_cache_memory_bytes=2**21, max_num_seqs=48)  # fmt: skip
    return LLM(**{**common, **kwargs})


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [3 + (7 * i + 5 * salt) % 90 for i in range(length)]


def _result(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY, others=()):
    """The target's (tokens, logprobs), run beside `others`."""
    requests = [{"prompt_token_ids": p} for p in [prompt, *others]]
    out = llm.generate(requests, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


def _outputs(llm: LLM, prompts, params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o for out in outs for o in out.outputs]


def _assert_logprobs_close(got, want) -> None:
    """vLLM's check_logprobs_close: the same tokens until the first that differs, where each
    side's token is among the other's top logprobs; the chosen tokens' logprobs before it
    within 0.1 (a recurrent state carries an activation that rounds to the other int8 step
    in one path into every later token, so they drift by up to a few hundredths)."""
    for a, b in zip(got, want, strict=True):
        for token_a, token_b, top_a, top_b in zip(a.token_ids, b.token_ids, a.logprobs,
                                                  b.logprobs, strict=True):  # fmt: skip
            if token_a != token_b:
                assert token_a in top_b and token_b in top_a
                break
            assert abs(top_a[token_a].logprob - top_b[token_b].logprob) < 0.1


def test_the_native_step_gives_the_pytorch_layers_tokens(hybrid):
    native = _engine(hybrid)
    reference = _engine(hybrid)
    reference.llm_engine.runner.native_step = None  # the same blocks through PyTorch
    assert native.llm_engine.runner.decode_path == "native step"
    prompts = [_prompt(3 + 9 * i, salt=i) for i in range(5)]
    _assert_logprobs_close(_outputs(native, prompts), _outputs(reference, prompts))
    steps = native.llm_engine.runner.native_steps
    assert steps >= GREEDY.max_tokens and reference.llm_engine.runner.native_steps == 0


def test_in_bf16_the_native_step_is_as_close_to_fp32_as_the_pytorch_layers(tmp_path):
    """The native step keeps activations in fp32 between operations where the PyTorch
    layers round each to bf16, so the two bf16 paths part after a few tokens; the native
    one stays at least as close to fp32 on the same blocks."""
    _bf16_checkpoint("hybrid", tmp_path)
    prompts = [_prompt(3 + 5 * i, salt=i) for i in range(12)]
    reference = _outputs(_engine(tmp_path), prompts)
    native = _engine(tmp_path, dtype="bfloat16")
    torch_bf16 = _engine(tmp_path, dtype="bfloat16")
    torch_bf16.llm_engine.runner.native_step = None
    ours = _deviations(_outputs(native, prompts), reference)
    theirs = _deviations(_outputs(torch_bf16, prompts), reference)
    assert native.llm_engine.runner.native_steps >= GREEDY.max_tokens
    assert ours[len(ours) // 2] <= 1.2 * theirs[len(theirs) // 2] + 1e-3, (ours, theirs)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_requests_bits_do_not_depend_on_its_batch_or_chunks(hybrid, params):
    prompt = _prompt(300)  # past one native call's 256-row chunk
    alone = _result(_engine(hybrid), prompt, params)
    busy = _engine(hybrid)
    for count in (1, 7):
        others = [_prompt(5 + 11 * i, salt=i + 1) for i in range(count)]
        assert _result(busy, prompt, params, others) == alone, f"beside {count} others"
    for chunk in (16, 100):
        chunked = _engine(hybrid, max_num_batched_tokens=chunk, max_num_seqs=16)
        assert _result(chunked, prompt, params) == alone, f"chunked at {chunk}"


def test_checkpoint_hits_forks_and_preemption_give_the_same_bits(hybrid):
    system = _prompt(40, salt=2)
    turn = system + _prompt(9, salt=3)
    alone = _result(_engine(hybrid, enable_prefix_caching=False), turn)
    cached = _engine(hybrid)
    kv = cached.llm_engine.kv_manager
    # Checkpoints every 8 tokens, stopped for at any length, so these short prompts hit.
    kv.state_checkpoints = StateCheckpoints(kv.state_checkpoints.slots, kv.block_size, 8, 0)
    _result(cached, system + _prompt(5, salt=4))
    hit = _result(cached, turn)
    assert cached.llm_engine.prefix_cache_stats().hit_tokens >= 40
    assert hit == alone
    # n > 1: the samples fork from the prompt's state; each equals the request alone.
    forked = _outputs(cached, [turn], SamplingParams(n=3, temperature=0, max_tokens=12,
                                                     ignore_eos=True, logprobs=3))  # fmt: skip
    for sample in forked:
        assert sample.token_ids == alone[0]
    # Room for a few sequences only: growth preempts and recomputes some of them.
    tight = _engine(hybrid, kv_cache_memory_bytes=None, num_gpu_blocks_override=40,
                    max_model_len=80, enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    others = [_prompt(12, salt=i + 5) for i in range(7)]
    expected = _result(_engine(hybrid, enable_prefix_caching=False), _prompt(12), params)
    assert _result(tight, _prompt(12), params, others) == expected
    assert tight.llm_engine.stats().num_preemptions > 0


def test_rows_verifying_drafts_give_the_same_bits(hybrid):
    prompts = [_prompt(6 + 5 * i, salt=i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = _engine(hybrid)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = _engine(hybrid, speculative_config=spec)
    llm.llm_engine.proposer = OracleProposer(sequences(expected))
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert [s[t].logprob for t, s in zip(x.token_ids, x.logprobs, strict=True)] == [
            s[t].logprob for t, s in zip(y.token_ids, y.logprobs, strict=True)
        ]
    stats = llm.llm_engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert llm.llm_engine.runner.native_steps > 0


def _first_mtp_inputs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The hidden states the MTP drafter is first handed for a prompt (its catch-up)."""
    proposer = llm.llm_engine.proposer
    seen = []
    forward = proposer._forward
    proposer._forward = lambda chunks, hidden, logit_rows: (
        seen.append(hidden.clone()) or forward(chunks, hidden, logit_rows)
    )
    _outputs(llm, [prompt])
    return seen[0]


def test_mtp_drafts_read_the_native_steps_hidden_states(tmp_path):
    tiny = make_tiny_hybrid("interval", tmp_path, **VARIANTS["interval"])
    add_mtp_layer(tiny)
    prompts = [_prompt(7 + 4 * i, salt=i) for i in range(3)]
    expected = _outputs(_engine(tmp_path), prompts)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "adaptive_draft_length": False}
    llm = _engine(tmp_path, speculative_config=mtp)
    got = _outputs(llm, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert llm.llm_engine.runner.native_steps > 0
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    # The drafter reads the rows the PyTorch layers would hand it (same rows, same values
    # but for rounding): unnormed or misaligned rows (values of 1-5 here) would not match.
    # The rounding: silu(gate) * up differs in its last bits between the two, and the down
    # projection's activation codes (twelve-bit on the AVX-512 VNNI builds, int8 on AVX2)
    # turn such a difference into a code step now and then (twelve-bit: 0.04 at most, 0.002
    # on average; two int8 rows had taken 4e-5).
    reference = _engine(tmp_path, speculative_config=mtp)
    reference.llm_engine.runner.native_step = None
    prompt = _prompt(21, salt=7)
    ours, theirs = _first_mtp_inputs(llm, prompt), _first_mtp_inputs(reference, prompt)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, atol=0.1, rtol=0)
    assert (ours - theirs).abs().mean() < 1e-2


# Mixer shapes: small heads (only the delta rule's value-by-value tail), and value heads
# wider than a register stretch (8 vectors: 128 columns on AVX-512, 64 on AVX2) with a tail,
# whose 624 convolution channels span three blocks, the last one partial.
MIXER_SHAPES = {
    "small": dict(num_key_heads=2, num_value_heads=4, key_head_dim=12, value_head_dim=20),
    "wide": dict(num_key_heads=2, num_value_heads=4, key_head_dim=12, value_head_dim=144),
}


def _mixer_inputs(seed: int, shape_name: str = "small"):
    """A Gated DeltaNet layer (fp32, perturbed gates) and a step of four sequences: a prompt
    chunk from position 0, a chunk carrying on a sequence's state, a decode row with two
    rows verifying drafts, each storing its state in a slot of its own, and a decode row
    storing its state in the slot it read (updated in place)."""
    torch.manual_seed(seed)
    shape = LinearAttentionConfig(**MIXER_SHAPES[shape_name], conv_kernel=4)
    layer = GatedDeltaNet(48, shape, 1e-6).eval()
    with torch.no_grad():
        layer.in_proj.weight.normal_(0, 0.3)
        layer.out_proj.weight.normal_(0, 0.3)
        layer.conv1d_weight.normal_(0, 0.5)
        layer.dt_bias.normal_(0, 1.0)
        layer.A_log.normal_(0, 0.5)
        layer.norm.weight.normal_(1, 0.3)
    slots = 9
    conv = torch.randn(slots, shape.conv_kernel - 1, shape.conv_channels)
    recurrent = 0.3 * torch.randn(
        slots, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim
    )
    conv[0], recurrent[0] = 0, 0  # the zero slot
    rows = dict(starts=np.array([0, 9, 30, 31, 32, 12]), query_lens=np.array([37, 5, 1, 1, 1, 1]),
                slots=np.array([1, 2, 3, 5, 6, 8]), reads=np.array([1, 2, 3, 3, 5, 8]),
                continues=np.array([False, False, False, True, True, False]))  # fmt: skip
    x = torch.randn(int(rows["query_lens"].sum()), 48)
    return layer, shape, conv, recurrent, rows, x


def _native_mixer(layer, shape, conv, recurrent, rows, projection) -> torch.Tensor:
    """The C mixer's output on the rows' projections (between in_proj and out_proj), the
    slots updated in place."""
    step = NativeDecodeStep.load()
    assert step is not None
    args = (rows["starts"], rows["query_lens"], rows["slots"])
    reads, writes = native_state_rows(*args, rows["reads"], rows["continues"], torch.device("cpu"))
    rows_count = projection.shape[0]
    with torch.no_grad():
        out = torch.empty(rows_count, shape.value_size)
        pointers = StepLinearLayer(
            layer.conv1d_weight.data_ptr(), layer.dt_bias.data_ptr(), layer.A_log.data_ptr(),
            layer.norm.weight.data_ptr(), conv.data_ptr(), recurrent.data_ptr(),
        )  # fmt: skip
        sizes = StepLinearShape(shape.num_key_heads, shape.num_value_heads, shape.key_head_dim,
                                shape.value_head_dim, shape.conv_kernel)  # fmt: skip
        function = step._library.forklift_linear_mixer
        function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
        function.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        failed = function(
            ctypes.byref(pointers), ctypes.byref(sizes), projection.data_ptr(),
            projection.shape[1], rows_count, reads.data_ptr(), writes.data_ptr(), 1e-6, 0,
            out.data_ptr(), 2,
        )  # fmt: skip
        assert failed == 0
        return out


@pytest.mark.parametrize("shape_name", list(MIXER_SHAPES))
def test_the_native_mixer_equals_the_pytorch_layer_in_fp32(shape_name):
    """The C mixer (convolution, recurrent delta rule token by token, gated norm) against
    the PyTorch layer (the chunked form for prompt chunks, the recurrent one for rows), on
    the same projections: outputs and every slot's states within 1e-5."""
    layer, shape, conv, recurrent, rows, x = _mixer_inputs(3, shape_name)
    args = (rows["starts"], rows["query_lens"], rows["slots"])
    meta = build_linear_metadata(*args, shape.conv_kernel, torch.device("cpu"), rows["reads"],
                                 rows["continues"])  # fmt: skip
    with torch.no_grad():
        conv_ref, recurrent_ref = conv.clone(), recurrent.clone()
        before = recurrent.clone()
        expected = layer(x, conv_ref, recurrent_ref, meta)
    with torch.no_grad():
        projection = layer.in_proj(x).contiguous()
        got = layer.out_proj(_native_mixer(layer, shape, conv, recurrent, rows, projection))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(recurrent, recurrent_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, conv_ref, atol=0, rtol=0)
    assert not torch.equal(recurrent[6], before[6])  # the last verifying row wrote its slot
    assert not torch.equal(recurrent[8], before[8])  # the decode row, in place
    assert torch.equal(recurrent[4], before[4]) and torch.equal(recurrent[7], before[7])


@pytest.mark.parametrize("shape_name", list(MIXER_SHAPES))
def test_a_decode_row_in_place_equals_its_token_in_a_prompt_chunk(shape_name):
    """A prompt's last token as a decode row updating its slot in place, after the rest as
    one chunk, gives the bits of the whole prompt as one chunk: the mixer's output and its
    states."""
    layer, shape, conv, recurrent, _, _ = _mixer_inputs(5, shape_name)
    with torch.no_grad():  # one projection for all 20 rows: torch's matmul is not batch-invariant
        projection = layer.in_proj(torch.randn(20, 48)).contiguous()
    whole = dict(starts=np.array([0]), query_lens=np.array([20]), slots=np.array([1]),
                 reads=np.array([1]), continues=np.array([False]))  # fmt: skip
    conv_whole, recurrent_whole = conv.clone(), recurrent.clone()
    at_once = _native_mixer(layer, shape, conv_whole, recurrent_whole, whole, projection)
    head = dict(starts=np.array([0]), query_lens=np.array([19]), slots=np.array([2]),
                reads=np.array([1]), continues=np.array([False]))  # fmt: skip
    tail = dict(starts=np.array([19]), query_lens=np.array([1]), slots=np.array([2]),
                reads=np.array([2]), continues=np.array([False]))  # fmt: skip
    _native_mixer(layer, shape, conv, recurrent, head, projection[:19].contiguous())
    last = _native_mixer(layer, shape, conv, recurrent, tail, projection[19:].contiguous())
    assert torch.equal(last, at_once[19:])
    assert torch.equal(recurrent[2], recurrent_whole[1])
    assert torch.equal(conv[2], conv_whole[1])


def test_a_hybrid_step_without_its_rows_state_slots_is_refused(tmp_path):
    make_tiny_hybrid("sandwich", tmp_path)
    llm = _engine(tmp_path)
    _outputs(llm, [[5, 6, 7]])  # binds the step to the weights and the cache
    backend = llm.llm_engine.runner.backend
    ids, positions = torch.tensor([5, 6]), torch.tensor([0, 1])
    groups = [(torch.tensor([4, 5]), torch.ones(2, 1, dtype=torch.int64), torch.zeros(2, 4))]
    with pytest.raises(ValueError, match="needs its rows' state slots"):
        backend.native_step(backend.binding, ids, positions, groups)
    carried_on = (torch.tensor([-1, -1]), torch.tensor([-1, 1]))  # a first row with no state
    with pytest.raises(ValueError, match="the first read"):
        backend.native_step(backend.binding, ids, positions, groups, states=carried_on)
    states = (torch.tensor([1, -1]), torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="this binding has none"):  # an MTP layer's input
        backend.native_step(backend.binding, ids, positions, groups, states=states,
                            input_hidden=torch.zeros(2, backend.binding.hidden))  # fmt: skip
