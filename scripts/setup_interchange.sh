#!/usr/bin/env bash
# Create .venv-interchange (if missing): the other training projects' own code from PyPI, SpecForge and speculators
# (vLLM's), in a virtualenv of their own. The interchange tier writes hidden states in their offline layouts, reads
# them back with their own dataset readers here and checks that the kit's import (train/foreign_features.py) holds
# the same tokens, states and loss masks. Their readers are what the tier needs, not their trainers: the packages go
# in without their dependencies (SpecForge pins torch 2.11 and SGLang; speculators pulls torchvision and torchaudio,
# whose PyPI wheels would bring CUDA), and the reader's own imports are installed beside them. Shared set-up cache as
# the others (scripts/steps.sh); a finished install records the hash of its inputs in .venv-interchange/.ready.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_INTERCHANGE_VENV:-.venv-interchange}
PROJECTS=(specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0)
# what their dataset readers import (speculators.train.data, specforge.data.preprocessing), in their pinned ranges
READER_DEPS=("datasets>=4.0,<=5.1.0" transformers==5.8.1 safetensors "numpy<=2.5.4" loguru pydantic pydantic-settings
    openai httpx aiohttp rich typer click tqdm psutil protobuf)
STEP_PREFIX=setup-interchange
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
link_cached_env "$VENV" interchange scripts/setup_interchange.sh scripts/steps.sh "${PROJECTS[@]}" "${READER_DEPS[@]}"
[ "$(cat "$VENV/.ready" 2>/dev/null)" = "$ENV_KEY" ] && exit 0
cpu_torch_venv "$VENV"
step "installing the readers' dependencies" "$(venv_python "$VENV")" -m pip install -q "${READER_DEPS[@]}"
step "installing ${PROJECTS[*]} (without their dependencies)" \
    "$(venv_python "$VENV")" -m pip install -q --no-deps "${PROJECTS[@]}"
step "checking that their readers import" "$(venv_python "$VENV")" -c \
    "from speculators.train.data import ArrowDataset; from specforge.data.preprocessing import OfflineEagle3Dataset"
echo "$ENV_KEY" >"$VENV/.ready"
echo "setup-interchange: ready ($VENV)"
