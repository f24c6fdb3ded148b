"""The native decode step on dense bf16 weights (AMX tiles, csrc/dense_matmul_amx.h, or
AVX512-BF16 dot products, csrc/dense_matmul_dots.h): what an RL rollout runs, its weights
pushed in unquantized. The matmul equals a bf16 x bf16 product accumulated in fp32; the step
it runs is at least as close to an fp32 model as the PyTorch bf16 layers are (it keeps
activations in fp32 between operations), follows weight updates, and says in the log that it
runs. Skipped where the CPU has neither."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_hybrid, make_tiny_model, save_with_weight

from forklift import LLM, SamplingParams
from forklift.cpu import cpu_flags
from forklift.model.native_binding import DENSE_STEP_MAX_ROWS
from forklift.native import build as native_build
from forklift.native.dense_weights import DenseMatmulKernel, pack_dense, pack_dense_all

KERNEL = DenseMatmulKernel.load() if native_build.find_compiler() is not None else None
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no dense bf16 kernel here")


@pytest.mark.parametrize("shape", [(50, 40), (960, 576), (33, 64), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 64, 70])
def test_tile_matmul_is_the_bf16_product(shape, rows):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + rows)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen)
    want = x.bfloat16().double() @ weight.double().T
    got = KERNEL(x, pack_dense(weight), n)
    assert got.shape == (rows, n)
    # fp32 sums of k bf16 products, in the kernel's order
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def _dot_products_kernel() -> DenseMatmulKernel | None:
    """On an AMX CPU, the AVX512-BF16 dot products built without the tiles (which such a CPU
    runs too), so they are run here and not only compiled; None elsewhere (KERNEL is them)."""
    if "amx_bf16" not in cpu_flags():
        return None
    no_tiles = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
    return DenseMatmulKernel.load(("-march=native", "-mprefer-vector-width=512", *no_tiles))


@pytest.mark.parametrize("which", ["this CPU's", "dot products"])
@pytest.mark.parametrize("shape", [(50, 40), (33, 64), (96, 130)])
def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(which, shape):
    kernel = KERNEL if which == "this CPU's" else _dot_products_kernel()
    if kernel is None:
        pytest.skip("the dot products are this CPU's kernel")
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    packed = pack_dense(torch.randn(n, k, generator=gen).bfloat16())
    x = torch.randn(70, k, generator=gen)
    alone = torch.cat([kernel(x[r : r + 1], packed, n) for r in range(70)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for rows in (2, 7, 8, 9, 16, 17, 33, 70):
                assert torch.equal(kernel(x[:rows], packed, n), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_weights_packed_in_one_buffer_equal_each_packed_alone():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n, k in ((96, 64), (50, 40))]
    weights.append(torch.randn(8192, 1024, generator=gen).bfloat16())  # enough for huge pages
    packed, buffer = pack_dense_all(weights)
    for together, alone in zip(packed, weights, strict=True):
        assert torch.equal(together, pack_dense(alone))
    # Updated weights of the same shapes pack into the same buffer; other shapes get another.
    changed = [-w for w in weights]
    repacked, same = pack_dense_all(changed, buffer)
    if buffer is not None:
        assert same is buffer and repacked[0].data_ptr() == packed[0].data_ptr()
    for together, alone in zip(repacked, changed, strict=True):
        assert torch.equal(together, pack_dense(alone))
    _, other = pack_dense_all(changed[1:], buffer)
    assert other is not buffer or buffer is None
    with pytest.raises(ValueError, match="2-D"):
        pack_dense(torch.zeros(8))


def _bf16_checkpoint(arch: str, directory) -> None:
    """A tiny model whose stored weights are bf16 values, so an fp32 engine reads exactly the
    weights the bf16 engines compute with. "hybrid": a Qwen3.5 hybrid (Gated DeltaNet
    layers beside gated attention)."""
    if arch == "hybrid":
        make_tiny_hybrid("interval", directory, linear_value_head_dim=8)
    else:
        make_tiny_model(arch, directory)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({name: t.bfloat16().float() for name, t in tensors.items()}, path,
                  metadata={"format": "pt"})  # fmt: skip


def _engine(path, dtype: str = "bfloat16", **kwargs) -> LLM:
    return LLM(model=str(path), dtype=dtype, max_model_len=256, block_size=4,
               kv_cache_memory_bytes=2**22, max_num_seqs=DENSE_STEP_MAX_ROWS, **kwargs)  # fmt: skip


def _generate(llm: LLM, prompts, tokens: int = 16):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0] for out in outs]


def _deviations(got, want) -> list[float]:
    """|logprob difference| of each chosen token, up to where the two greedy texts part."""
    deviations = []
    for a, b in zip(got, want, strict=True):
        for token, other, step_a, step_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs,
                                                strict=True):  # fmt: skip
            deviations.append(abs(step_a[token].logprob - step_b[token].logprob)
                              if token in step_b else float("inf"))  # fmt: skip
            if token != other:
                break
    return sorted(deviations)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "hybrid"])
def test_dense_step_is_as_close_to_fp32_as_the_pytorch_bf16_layers(tmp_path, arch):
    _bf16_checkpoint(arch, tmp_path)
    native = _engine(tmp_path)
    assert native.llm_engine.runner.decode_path == "native step"
    torch_bf16 = _engine(tmp_path, decode_backend="torch")
    assert torch_bf16.llm_engine.runner.native_step is None
    fp32 = _engine(tmp_path, dtype="float32")
    # 40 rows: past the row count from which the per-row work runs on every thread
    prompts = [[5 + i, 17, 3 * i + 1, 40, 9][: 2 + i % 4] for i in range(40)]
    reference = _generate(fp32, prompts)
    ours = _deviations(_generate(native, prompts), reference)
    theirs = _deviations(_generate(torch_bf16, prompts), reference)
    assert native.llm_engine.runner.native_steps >= 15
    middle, high = len(ours) // 2, len(ours) * 9 // 10
    assert ours[middle] <= 1.2 * theirs[len(theirs) // 2] + 1e-3, (ours[middle], theirs)
    assert ours[high] <= 1.2 * theirs[len(theirs) * 9 // 10] + 1e-3, (ours[high], theirs)
    # A hybrid's recurrent state carries each rounding into every later token: its bound is
    # the PyTorch bf16 layers' own worst step.
    bound = max(0.5, 1.5 * theirs[-1]) if arch == "hybrid" else 0.5
    assert ours[-1] < bound, (ours[-1], theirs[-1])


def test_dense_step_follows_weight_updates(tmp_path):
    tiny = make_tiny_model("qwen3", tmp_path / "a")
    llm = _engine(tmp_path / "a")
    prompts = [[9, 4, 21], [30, 2], [8, 8, 1, 5]]
    before = _generate(llm, prompts)
    name = "model.layers.1.mlp.down_proj.weight"
    changed = -0.5 * tiny.hf_model.state_dict()[name]
    llm.update_weights([(name, changed)])
    assert llm.llm_engine.runner.backend.binding is not None  # packed in the update itself
    save_with_weight(tiny, tmp_path / "a", tmp_path / "b", name, changed)
    after = _generate(llm, prompts)
    fresh = _generate(_engine(tmp_path / "b"), prompts)
    for a, b in zip(after, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before, strict=True))
    assert llm.llm_engine.runner.native_steps > 0


def test_the_log_says_the_dense_step_runs(tmp_path, caplog):
    make_tiny_model("llama", tmp_path)
    with caplog.at_level(logging.INFO, logger="forklift"):
        dense = _engine(tmp_path)
        fp32 = _engine(tmp_path, dtype="float32")
        split = _engine(tmp_path, batch_invariant=False)
    kernel = "AMX tiles" if "amx_bf16" in cpu_flags() else "AVX512-BF16 dot products"
    assert f"every step: one native call on dense bf16 weights ({kernel}" in caplog.text
    assert dense.llm_engine.runner.one_forward
    assert dense.llm_engine.runner.native_step_max_rows is None  # prefill chunks too
    # The opt-out: decode steps of up to 64 rows on the tiles, prefill on oneDNN's GEMM.
    assert "prefill on the PyTorch layers (batch_invariant off)" in caplog.text
    assert not split.llm_engine.runner.one_forward
    assert split.llm_engine.runner.native_step_max_rows == DENSE_STEP_MAX_ROWS
    _generate(split, [[5, 17, 3, 8, 1, 9]], tokens=4)
    assert split.llm_engine.runner.native_steps == 3  # the decodes, not the prompt
    # fp32 weights stay on the PyTorch layers (exact HF parity)
    assert fp32.llm_engine.runner.native_step is None


@pytest.mark.parametrize("level", [1, 2])
def test_dense_step_through_sleep_and_wake(tmp_path, level):
    make_tiny_model("llama", tmp_path)
    llm = _engine(tmp_path)
    prompts = [[5, 17, 3], [9, 4, 21, 2]]
    before = _generate(llm, prompts)
    llm.sleep(level=level)
    llm.wake_up()
    after = _generate(llm, prompts)
    for a, b in zip(after, before, strict=True):
        assert a.token_ids == b.token_ids
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)
    assert llm.llm_engine.runner.native_steps >= 2 * 15
