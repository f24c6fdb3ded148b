"""A Qwen3.5-0.8B-shaped hybrid GGUF (llama.cpp's `qwen35`) in Q4_K_M and Q8_0 from random
weights, made by llama.cpp's own converter and quantizer, for measuring forklift's native
hybrid step against llama.cpp on a file of the family's smallest released shape: hidden
1024, 24 layers (three Gated DeltaNet layers, then one gated full-attention layer), 8 heads
of 256 with 2 KV heads and a quarter of each rotated, intermediate 3584, linear layers of
16 key and 16 value heads of 128 with a convolution of 4, vocabulary 248,320, tied
embeddings (Qwen3.5-0.8B's text config). The default model's tokenizer serves (the
converter pads its vocabulary to the model's). The files are not committed; this makes them.

    ../shared/peers/build_llama_cpp.sh $HOME/.cache/llama-cpp     # llama-quantize, the converter
    .venv/bin/python benchmarks/scripts/make_hybrid_gguf.py --llama-cpp $HOME/.cache/llama-cpp \\
        --out-dir OUT_DIR

Needs about 5 GB of free disk while it runs (the bf16 directory and GGUF are removed at the
end) and 8 GB of memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from random_gguf import make_random_gguf

SHAPES = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=8192,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                     "partial_rotary_factor": 0.25},
)  # fmt: skip
QUANTS = ("Q4_K_M", "Q8_0")


def random_model(directory: Path, vocab_size: int, bos: int, eos: int) -> None:
    """The HF directory: random bf16 weights of a scale that keeps activations finite, at
    the model's own vocabulary size (the converter pads the tokenizer's to it)."""
    del vocab_size
    config = transformers.Qwen3_5TextConfig(
        **SHAPES, bos_token_id=bos, eos_token_id=eos, initializer_range=0.02,
        torch_dtype="bfloat16",
    )  # fmt: skip
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="build_llama_cpp.sh's dir")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    outputs = {kind: args.out_dir / f"qwen35-0.8b-random.{kind}.gguf" for kind in QUANTS}
    make_random_gguf(args.llama_cpp, args.out_dir / "hybrid-work", random_model, outputs,
                     ["--no-mtp"])  # fmt: skip


if __name__ == "__main__":
    main()
