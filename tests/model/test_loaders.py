"""Safetensors / GGUF loaders and model resolution."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
from gguf_factory import write_gguf
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from forklift.checkpoint.gguf_file import open_gguf
from forklift.checkpoint.source import ModelSource, default_model_path, resolve_model
from forklift.model.gguf_loader import gguf_model_config, iter_gguf_weights
from forklift.model.model_config import ModelConfig
from forklift.model.model_source import iter_model_weights, load_model_config
from forklift.model.safetensors_loader import iter_safetensors_weights, load_hf_model_config

_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=128,
)

# Upper bounds on ||dequantized - original|| / ||original|| for standard-normal weights.
_REL_TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_1": 0.12, "Q4_0": 0.15}
_QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def _tiny_model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_TINY))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**_TINY, sliding_window=32))
    elif arch == "qwen2":
        cfg = Qwen2Config(**_TINY, tie_word_embeddings=True, bos_token_id=5, eos_token_id=7)
        model = Qwen2ForCausalLM(cfg)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=32, eos_token_id=3))
    # Random norms and biases too, so a misrouted vector cannot pass as all-ones or zeros.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model


def _saved_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint stores it: no lm_head copy when embeddings are tied."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = _tiny_model(request.param)
    model_dir = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(model_dir, safe_serialization=True)
    return request.param, model, model_dir


@pytest.fixture(scope="module")
def default_reader() -> gguf.GGUFReader:
    return open_gguf(default_model_path())


# --- Hugging Face directories -------------------------------------------------------------


def test_hf_config(tiny) -> None:
    arch, model, model_dir = tiny
    config = load_hf_model_config(model_dir)
    assert config.architecture == arch
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (64, 128, 128)
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.qkv_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.sliding_window == (32 if arch == "mistral" else None)


def test_hf_weights_match_state_dict(tiny) -> None:
    _, model, model_dir = tiny
    expected = _saved_state(model)
    loaded = dict(iter_safetensors_weights(model_dir))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_hf_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model_config(tmp_path)


def test_pickle_checkpoint_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**_TINY).to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    with pytest.raises(ValueError, match="safetensors"):
        list(iter_safetensors_weights(tmp_path))
    with pytest.raises(ValueError, match="safetensors"):
        list(iter_model_weights(resolve_model(str(tmp_path)), load_hf_model_config(tmp_path)))


def test_truncated_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.randn(64, 64)}, path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors"):
        list(iter_safetensors_weights(tmp_path))


# --- GGUF files written from the tiny models -------------------------------------------------


def test_gguf_config_matches_hf(tiny, tmp_path: Path) -> None:
    _, model, model_dir = tiny
    path = write_gguf(tmp_path / "m.gguf", model, model.state_dict())
    assert gguf_model_config(open_gguf(path)) == load_hf_model_config(model_dir)


@pytest.mark.parametrize("qtype", _QTYPES)
def test_gguf_weights_roundtrip(tiny, qtype: str, tmp_path: Path) -> None:
    _, model, _ = tiny
    expected = _saved_state(model)
    path = write_gguf(tmp_path / "m.gguf", model, model.state_dict(), qtype=qtype)
    reader = open_gguf(path)
    loaded = dict(iter_gguf_weights(reader, gguf_model_config(reader)))
    assert sorted(loaded) == sorted(expected)
    for name, original in expected.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        if qtype == "F32" or original.dim() == 1:
            assert torch.equal(got, original), name
            continue
        # Quantization acts on row blocks, so it commutes with the converter's row permutation:
        # the result must be exactly the quantize/dequantize round trip of the HF tensor.
        ggml_type = gguf.GGMLQuantizationType[qtype]
        roundtrip = gguf.quants.dequantize(
            gguf.quants.quantize(original.numpy(), ggml_type), ggml_type
        )
        assert np.array_equal(got.numpy(), roundtrip.reshape(original.shape)), name
        error = (got - original).norm() / original.norm()
        assert error < _REL_TOLERANCE[qtype], (name, float(error))


def test_gguf_metadata_fallbacks(tmp_path: Path) -> None:
    hf = LlamaConfig(**_TINY).to_dict()
    hf["rope_parameters"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 500000.0,
    }
    model = _tiny_model("llama")
    tokens = {"tokenizer.ggml.tokens": [f"t{i}" for i in range(128)]}
    path = write_gguf(
        tmp_path / "m.gguf", hf, model.state_dict(), tokenizer=tokens, write_vocab_size=False
    )
    config = gguf_model_config(open_gguf(path))
    assert config.vocab_size == 128
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    assert config.head_dim == 16 and not config.tie_word_embeddings


@pytest.mark.parametrize(
    ("arch", "message"),
    [("gpt2", "gpt2"), ("qwen3next", "qwen3next.*mixture-of-experts")],
)
def test_gguf_unsupported_architecture(tmp_path: Path, arch: str, message: str) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
        gguf_model_config(open_gguf(tmp_path / "m.gguf"))


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    # An integer tensor: a type gguf.quants cannot dequantize.
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    writer.add_tensor("output_norm.weight", np.zeros(64, np.int8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelConfig("llama", 128, 64, 128, 1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"output_norm\.weight.*I8"):
        list(iter_gguf_weights(open_gguf(tmp_path / "bad.gguf"), config))


def test_gguf_truncated_in_tensor_data(tmp_path: Path) -> None:
    model = _tiny_model("llama")
    path = write_gguf(tmp_path / "m.gguf", model, model.state_dict())
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="m.gguf"):
        open_gguf(path)


# --- The bundled default model ---------------------------------------------------------------


def test_default_model_config(default_reader: gguf.GGUFReader) -> None:
    config = gguf_model_config(default_reader)
    assert config.architecture == "llama"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.hidden_size, config.vocab_size, config.head_dim) == (576, 49152, 64)
    assert config.tie_word_embeddings
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 100000.0


def test_default_model_unpermute_matches_transformers(default_reader: gguf.GGUFReader) -> None:
    """transformers' own GGUF import (LlamaTensorProcessor) must agree on q and k layouts."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = gguf_model_config(default_reader)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    raw = {t.name: t for t in default_reader.tensors}
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    ours = {}
    for name, tensor in iter_gguf_weights(default_reader, config):
        if name in wanted:
            ours[name] = tensor
        if len(ours) == len(wanted):
            break
    for gguf_name, hf_name in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
    ):
        t = raw[gguf_name]
        dequantized = gguf.quants.dequantize(t.data, t.tensor_type)
        reference = processor.process(weights=dequantized, name=gguf_name).weights
        assert torch.allclose(ours[hf_name], torch.from_numpy(np.copy(reference)), atol=1e-6)
        assert not torch.allclose(ours[hf_name], torch.from_numpy(dequantized), atol=1e-6)


def test_truncated_default_model(tmp_path: Path) -> None:
    path = tmp_path / "truncated.gguf"
    with default_model_path().open("rb") as src:
        path.write_bytes(src.read(1 << 20))
    with pytest.raises(ValueError, match="truncated.gguf"):
        open_gguf(path)


# --- Errors and model resolution -------------------------------------------------------------


def test_open_gguf_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        open_gguf(tmp_path / "missing.gguf")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        open_gguf(bogus)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        open_gguf(empty)


def test_resolve_model(tmp_path: Path, tiny) -> None:
    _, model, model_dir = tiny
    assert resolve_model(None) == ModelSource(default_model_path(), "gguf")
    assert resolve_model(str(model_dir)) == ModelSource(model_dir, "hf")
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    path = write_gguf(gguf_dir / "only.gguf", model, model.state_dict())
    assert resolve_model(str(path)) == ModelSource(path, "gguf")
    assert resolve_model(str(gguf_dir)) == ModelSource(path, "gguf")
    source = resolve_model(str(gguf_dir))
    config = load_model_config(source)
    assert isinstance(config, ModelConfig)
    names = {name for name, _ in iter_model_weights(source, config)}
    assert names == set(_saved_state(model))
    hf_source = resolve_model(str(model_dir))
    assert load_model_config(hf_source) == load_hf_model_config(model_dir)


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="does not download"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF"):
        resolve_model(str(tmp_path))
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model(str(text))
