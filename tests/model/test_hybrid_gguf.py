"""Qwen3.5 hybrid GGUF files (llama.cpp's `qwen35` layout) against the HF directories they
were converted from. The fixtures under tests/data/hybrid_gguf come from llama.cpp's own
converter (scripts/make_hybrid_gguf_fixtures.py)."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny_models import hf_greedy

from forklift import LLM, SamplingParams
from forklift.model.gguf_hybrid import blocks_to_hf_layout, to_hf_layout
from forklift.model.gguf_loader import (
    gguf_model_config,
    iter_gguf_int8_blocks,
    iter_gguf_weights,
)
from forklift.model.layers.quantized import Int8Blocks
from forklift.model.model_config import LinearAttentionConfig
from forklift.model.safetensors_loader import load_hf_model_config

FIXTURES = Path(__file__).parents[1] / "data" / "hybrid_gguf"
VARIANTS = ["interval", "odd-heads"]  # interval: two value heads per key head, an MTP layer
NEW_TOKENS = 16


def _reader(variant: str, kind: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(FIXTURES / variant / f"model-{kind}.gguf")


def _hf_model(variant: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURES / variant, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # compare whole continuations
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_gguf_config_is_the_hf_directorys(variant):
    from_gguf = gguf_model_config(_reader(variant, "f32"))
    from_hf = load_hf_model_config(FIXTURES / variant)
    for field in (
        "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
        "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
        "tie_word_embeddings", "qk_norm", "qkv_bias", "layer_types", "linear_attention",
        "partial_rotary_factor", "attention_output_gate", "zero_centred_norms", "o_proj_bias",
    ):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_weights_read_back_as_the_checkpoints(variant):
    reader = _reader(variant, "f32")
    config = gguf_model_config(reader)
    checkpoint = load_file(FIXTURES / variant / "model.safetensors")
    weights = dict(iter_gguf_weights(reader, config))
    # The MTP layer (extra blocks in the file) is left out, as the HF model leaves it out.
    expected = {n for n in checkpoint if not n.startswith("mtp.")}
    assert set(weights) == expected
    if variant == "interval":
        assert any(t.name.startswith("blk.4.nextn") for t in reader.tensors)
    for name, tensor in weights.items():
        # A_log comes back through log(exp(.)), a zero-centred norm's w through (1 + w) - 1:
        # a rounding away (the model computes 1 + w, which the file holds exactly).
        rtol, atol = 0.0, 0.0
        if name.endswith("A_log"):
            rtol = 1e-6
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            atol = 2**-23
        torch.testing.assert_close(tensor, checkpoint[name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_file_generates_as_transformers_does(variant):
    hf = _hf_model(variant)
    rng = random.Random(len(variant))
    prompts = [[rng.randrange(3, 330) for _ in range(n)] for n in (1, 9, 40, 70)]
    llm = LLM(
        model=str(FIXTURES / variant / "model-f32.gguf"),
        dtype="float32",
        max_model_len=256,
        block_size=4,
        kv_cache_memory_bytes=2**21,
        max_num_batched_tokens=32,  # the long prompts are prefilled in chunks
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        assert got == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_q8_0_blocks_come_back_in_hf_order(variant):
    reader = _reader(variant, "q8_0")
    config = gguf_model_config(reader)
    dense = dict(iter_gguf_weights(reader, config))
    checkpoint = load_file(FIXTURES / variant / "model.safetensors")
    blocks = dict(iter_gguf_int8_blocks(reader, config))
    # Every linear-attention projection with a value-head axis is among them.
    assert any(name.endswith("in_proj_qkv.weight") for name in blocks)
    assert any(name.endswith("in_proj_a.weight") for name in blocks)
    for name, block in blocks.items():
        assert torch.equal(block.dequantize(), dense[name]), name
        # and lands within a step of the checkpoint's value (half a step of rounding, plus the
        # fp16 rounding of the step itself): a misplaced row would miss by the weights' scale.
        step = block.scales.repeat_interleave(32, dim=1)
        assert ((dense[name] - checkpoint[name]).abs() <= step).all(), name


def test_out_proj_blocks_move_whole_groups_and_refuse_to_cut_them():
    shape = LinearAttentionConfig(
        num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=64, conv_kernel=4
    )
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (16, shape.value_size), dtype=torch.int8, generator=generator)
    scales = torch.rand(16, shape.value_size // 32, generator=generator)
    file_blocks = Int8Blocks(codes, scales)
    name = "model.layers.0.linear_attn.out_proj.weight"
    parts = blocks_to_hf_layout(name, (codes, scales), shape)
    assert parts is not None
    expected = to_hf_layout(file_blocks.dequantize().numpy(), name, shape)
    assert np.array_equal(Int8Blocks(*parts).dequantize().numpy(), expected)
    # the value heads are back in HF's order: not the file's
    assert not np.array_equal(expected, file_blocks.dequantize().numpy())

    narrow = LinearAttentionConfig(2, 4, 8, 12, 4)  # 12-value heads would cut 32-value groups
    assert blocks_to_hf_layout(name, (codes[:, :48], scales[:, :1]), narrow) is None


def test_the_files_vocabulary_and_chat_template_are_the_directorys():
    variant = FIXTURES / "interval"
    llm = LLM(model=str(variant / "model-q8_0.gguf"), max_model_len=256)
    hf = transformers.AutoTokenizer.from_pretrained(variant)
    texts = [
        "Hello world, it's 2026!\n\tdef f(x): return x**2  # done",
        "Café naïve façade, e\u0301t\u00e9 — 東京 😀 l'été 12345",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    tokenizer = llm.get_tokenizer()
    for text in texts:
        assert tokenizer.encode(text) == hf.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    prompt = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt
    assert prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_quantized_hybrid_file_serves_its_blocks(caplog):
    caplog.set_level("INFO", logger="forklift")
    llm = LLM(model=str(FIXTURES / "interval" / "model-q8_0.gguf"), max_model_len=256)
    # in_proj (q/k/v, z, b, a) of 3 linear layers, qkv and o of the full one, 4 MLPs' two
    # projections and the untied head; out_proj is F16 in the file (48 inputs: not blocks).
    assert "14 tensors int8 from gguf blocks" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_mixture_of_experts_hybrid_files_are_refused_by_name(tmp_path):
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(path, "qwen35moe")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'qwen35moe' is a mixture-of-experts"):
        gguf_model_config(gguf.GGUFReader(path))


def test_a_hybrid_file_without_its_linear_layer_shape_is_refused_by_key(tmp_path):
    path = tmp_path / "no-ssm.gguf"
    writer = gguf.GGUFWriter(path, "qwen35")
    writer.add_block_count(4)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="lacks the required key qwen35.ssm.time_step_rank"):
        gguf_model_config(gguf.GGUFReader(path))
