#!/usr/bin/env bash
# vLLM's CPU build (the venv of the peers' vllm_cpu_setup.sh) serving the bf16 directory that
# setup makes from the default model, as `forklift bench serve` starts a peer:
#   forklift bench serve --peer-url http://127.0.0.1:8092/v1 \
#       --peer-command 'bash benchmarks/scripts/vllm_peer.sh 8092' ...
# Both cores compute (BIND=0-1, its best binding); `avx2` holds it to its AVX2 kernels in
# float32 (vllm_avx2_only/sitecustomize.py), as forklift's AVX2 kind is measured.
# Usage: vllm_peer.sh PORT [avx2] ; env VLLM_VENV, SMOLLM2_HF, BIND
set -euo pipefail
PORT=${1:?port}
KIND=${2:-native}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/forklift-peers
V=${VLLM_VENV:-$CACHE/vllm-cpu-venv}
M=${SMOLLM2_HF:-$CACHE/smollm2-hf}
HERE=$(cd "$(dirname "$0")" && pwd)
DTYPE=bfloat16
if [ "$KIND" = avx2 ]; then
  export PYTHONPATH="$HERE/vllm_avx2_only${PYTHONPATH:+:$PYTHONPATH}"
  export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
  DTYPE=float32
fi
exec env HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=4 \
  VLLM_USE_AOT_COMPILE=0 VLLM_CPU_OMP_THREADS_BIND="${BIND:-0-1}" \
  LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$V/lib/libiomp5.so" \
  "$V/bin/python" -m vllm.entrypoints.openai.api_server --model "$M" --served-model-name smollm2 \
  --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --max-model-len 4096 --disable-log-stats \
  --disable-uvicorn-access-log
