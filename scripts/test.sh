#!/usr/bin/env bash
# The README's test command: set up .venv, the guidellm client's .venv-guidellm, vLLM's .venv-vllm, SGLang's
# .venv-sglang and a real Helm CLI in .tools/helm (each reused once made), then run the default test tier (CPU; the
# vLLM tier runs vLLM's server on the zoo's engines, the SGLang tier runs SGLang's own argument checks on every
# command the kit and chart write, the chart tests render and lint with Helm itself).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_guidellm.sh
bash scripts/setup_vllm.sh
bash scripts/setup_sglang.sh
bash scripts/setup_helm.sh
.venv/bin/python -m pytest "$@"
