"""Text <-> token ids for a model: its vocabulary (GGUF or Hugging Face) and chat template."""

from forklift.tokenizer.special_tokens import SpecialTokens
from forklift.tokenizer.tokenizer import CHAT_TEMPLATE_ARGUMENTS, Tokenizer, load_tokenizer

__all__ = ["CHAT_TEMPLATE_ARGUMENTS", "SpecialTokens", "Tokenizer", "load_tokenizer"]
