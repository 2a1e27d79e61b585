#!/usr/bin/env bash
# The README's test command: set up .venv, the guidellm client's .venv-guidellm and vLLM's .venv-vllm (each
# reused once made), then run the default test tier (CPU; the vLLM tier runs vLLM's server on three engines).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_guidellm.sh
bash scripts/setup_vllm.sh
.venv/bin/python -m pytest "$@"
