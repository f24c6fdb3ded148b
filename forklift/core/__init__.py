"""The engine's torch-free core: requests, the block pool, the KV cache manager, the scheduler
and the scheduler's output as plain data. Nothing under this package imports torch."""
