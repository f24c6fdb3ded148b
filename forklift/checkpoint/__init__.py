"""What a checkpoint is on disk: where a model lives and what its tensors are named.
Torch-free, so tokenizers and tools can read a model without loading torch."""
