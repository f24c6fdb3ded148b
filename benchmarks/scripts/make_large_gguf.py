"""A 3B-shaped Llama GGUF in Q4_K_M from random weights, made by llama.cpp's own converter and
quantizer, for measuring forklift against llama.cpp on a file of the size people run. The
default model's tokenizer serves (its vocabulary of 49,152 tokens); the shapes are Llama 3.2
3B's otherwise (hidden 3072, 28 layers, 24 heads, 8 KV heads, intermediate 8192, tied
embeddings): 2.97B parameters. The file is not committed; this makes it again.

    ../shared/peers/build_llama_cpp.sh $HOME/.cache/llama-cpp     # llama-quantize, the converter
    .venv/bin/python benchmarks/scripts/make_large_gguf.py --llama-cpp $HOME/.cache/llama-cpp \\
        --out OUT_DIR/llama-3b-random.Q4_K_M.gguf

The converter needs the `gguf` and `sentencepiece` packages in the Python that runs this
(`.venv/bin/pip install sentencepiece`; `gguf` comes with forklift). Needs about 13 GB of
free disk while it runs (the bf16 directory and the bf16 GGUF are removed at the end) and
12 GB of memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from random_gguf import make_random_gguf

SHAPES = dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def random_model(directory: Path, vocab_size: int, bos: int, eos: int) -> None:
    """The HF directory: random bf16 weights of a scale that keeps activations finite."""
    config = transformers.LlamaConfig(
        **SHAPES, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
        initializer_range=0.02, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="build_llama_cpp.sh's dir")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    make_random_gguf(args.llama_cpp, args.out.parent / "large-work", random_model,
                     {"Q4_K_M": args.out})  # fmt: skip


if __name__ == "__main__":
    main()
