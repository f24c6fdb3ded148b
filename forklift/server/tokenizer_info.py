"""GET /tokenizer_info as vLLM serves it: the model's `tokenizer_config.json` (the file
`forklift tokenizer export` writes), chat template included. lm-evaluation-harness's remote
tokenizer (`tokenizer_backend=remote`) reads its special tokens and chat template here and
tokenizes through /tokenize and /detokenize, so it needs no tokenizer directory."""

from __future__ import annotations

from typing import Any

from forklift.tokenizer import Tokenizer


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    info = tokenizer.tokenizer_config()
    # The longest prompt this server takes, not a limit of the vocabulary's own.
    info["model_max_length"] = max_model_len
    return info
