"""Text <-> token ids for a model: its vocabulary (GGUF or Hugging Face) and chat template."""

from forklift.tokenizer.special_tokens import SpecialTokens
from forklift.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["SpecialTokens", "Tokenizer", "load_tokenizer"]
