"""Benchmarks and calculators for forklift: KV-cache arithmetic, memory, throughput."""
