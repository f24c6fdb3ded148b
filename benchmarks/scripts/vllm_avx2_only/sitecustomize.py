"""Holds vLLM's CPU build to its AVX2 code on a newer x86-64 CPU, for a side-by-side run with
forklift's AVX2 path (`FORKLIFT_CPU_KIND=avx2`) on the same machine.

vLLM picks its kernel library (`_C_AVX2`, `_C_AVX512` or `_C`) and its attention and linear
back-ends from `torch.cpu`'s feature checks; Python imports this module at start-up in every
process that has this folder on PYTHONPATH (the API server and its engine core alike), so
those checks answer no to AVX-512 and AMX there. oneDNN's and ATen's own kernels are capped by
their environment variables. Start the server (the command of the peers'
`serve_vllm_aiperf.sh`) with:

    PYTHONPATH=benchmarks/scripts/vllm_avx2_only ONEDNN_MAX_CPU_ISA=AVX2 \\
    ATEN_CPU_CAPABILITY=avx2 ... -m vllm.entrypoints.openai.api_server ... --dtype float32

Its maps then show `_C_AVX2.abi3.so` loaded and no other of vLLM's kernel libraries.
"""

import torch

for _check in (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _check):
        setattr(torch.cpu, _check, lambda: False)
