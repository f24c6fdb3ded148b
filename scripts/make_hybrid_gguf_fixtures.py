"""Write the tests' Qwen3.5 hybrid GGUF fixtures with llama.cpp's own converter.

    .venv/bin/python scripts/make_hybrid_gguf_fixtures.py LLAMA_CPP_SOURCE_DIR

LLAMA_CPP_SOURCE_DIR holds `convert_hf_to_gguf.py` (the peer build unpacks it under
`vendor/llama.cpp`). For each tiny random hybrid it writes `tests/data/hybrid_gguf/<variant>/`:
the HF directory (safetensors, config, a small byte-level BPE tokenizer with Qwen3.5's
pre-tokenizer) and the converter's `model-f32.gguf` and `model-q8_0.gguf`. The "interval"
variant also carries a multi-token-prediction layer (`mtp.*`), which the converter appends as
an extra block, as in released Qwen3.5 files.

The converter recognises a tokenizer by hashing how it splits a fixed text; a tokenizer
trained here is not in its table, so the script names its pre-tokenizer ("qwen35") itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import tiny_hybrid_model  # noqa: E402

OUT = ROOT / "tests" / "data" / "hybrid_gguf"

# Qwen3.5's pre-tokenizer split, as its tokenizer.json states it.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 320
MODEL_VOCAB = 336  # a few ids past the tokenizer's: the converter writes them as [PAD] tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The tests' tiny hybrids (tests/tiny_models.py), over this tokenizer's vocabulary.
VARIANTS = ("interval", "odd-heads")
OVERRIDES = dict(vocab_size=MODEL_VOCAB, bos_token_id=None, eos_token_id=2)
WITH_MTP = ("interval",)


def train_tokenizer(text: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def add_mtp_layer(directory: Path, variant: str, seed: int) -> None:
    """Append Qwen3.5's MTP tensors (one full-attention layer, its fc and norms) to the
    checkpoint; HF's model class ignores them, as it does for released checkpoints."""
    donor = tiny_hybrid_model(
        variant, seed + 1000, **OVERRIDES, num_hidden_layers=1, layer_types=["full_attention"]
    )
    hidden = donor.config.hidden_size
    weights = load_file(directory / "model.safetensors")
    for name, tensor in donor.model.layers[0].state_dict().items():
        weights[f"mtp.layers.0.{name}"] = tensor.clone()
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(hidden) * 0.3
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config_path = directory / "config.json"
    settings = json.loads(config_path.read_text())
    settings["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(settings, indent=2))


def write_hf_directory(directory: Path, variant: str, seed: int, tokenizer: Tokenizer) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tiny_hybrid_model(variant, seed, **OVERRIDES).save_pretrained(
        directory, safe_serialization=True
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    if variant in WITH_MTP:
        add_mtp_layer(directory, variant, seed)


# Runs llama.cpp's converter in a child process, its tokenizer check answered.
_CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""


def convert(llama_cpp: Path, directory: Path, outtype: str, with_mtp: bool) -> None:
    outfile = directory / f"model-{outtype}.gguf"
    args = [str(directory), "--outtype", outtype, "--outfile", str(outfile)]
    if not with_mtp:
        args.append("--no-mtp")  # the converter otherwise expects MTP tensors
    subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp), *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path, help="llama.cpp source directory")
    args = parser.parse_args()
    text = (ROOT / "tests" / "data" / "perplexity_text.txt").read_text()
    tokenizer = train_tokenizer(text + "\nCafé naïve façade — 東京 😀 def f(x):\n\treturn x\n")
    for seed, variant in enumerate(VARIANTS):
        directory = OUT / variant
        write_hf_directory(directory, variant, seed, tokenizer)
        for outtype in ("f32", "q8_0"):
            convert(args.llama_cpp, directory, outtype, variant in WITH_MTP)


if __name__ == "__main__":
    main()
