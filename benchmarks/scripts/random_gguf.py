"""A GGUF file from random weights the way people's files are made: the default model's
tokenizer exported beside a random HF model, llama.cpp's own converter to bf16, then its
quantizer into each type asked for. The working folder goes at the end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import transformers

# save_model(directory, vocabulary size, bos id, eos id): the random HF model, saved.
SaveModel = Callable[[Path, int, int, int], None]


def make_random_gguf(
    llama_cpp: Path,
    work: Path,
    save_model: SaveModel,
    outputs: dict[str, Path],
    converter_args: Sequence[str] = (),
) -> None:
    """Each of `outputs` (llama-quantize type -> file) made in `work`. `llama_cpp`: the
    directory ../shared/peers/build_llama_cpp.sh built into."""
    hf_dir, bf16_gguf = work / "hf", work / "model.bf16.gguf"
    work.mkdir(parents=True, exist_ok=True)
    if not (hf_dir / "model.safetensors").exists():  # (kept from an interrupted run)
        forklift = Path(sys.executable).with_name("forklift")
        subprocess.run([str(forklift), "tokenizer", "export", str(hf_dir)], check=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        save_model(hf_dir, len(tokenizer), tokenizer.bos_token_id or 0, tokenizer.eos_token_id)
    converter = next(llama_cpp.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    subprocess.run([sys.executable, str(converter), str(hf_dir), "--outtype", "bf16",
                    *converter_args, "--outfile", str(bf16_gguf)], check=True)  # fmt: skip
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    for kind, out in outputs.items():
        subprocess.run([str(quantize), str(bf16_gguf), str(out), kind], check=True)
        print(out, f"{out.stat().st_size / 2**30:.2f} GiB")
    shutil.rmtree(work)
