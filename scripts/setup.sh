#!/usr/bin/env bash
# Create .venv (if missing) and install the kit into it. CPU machines get the pinned CPU torch wheel;
# set TORCH_SPEC (e.g. "torch==2.13.0 --index-url <your CUDA index>") to choose another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install -q -e ".[${EXTRAS:-test}]"
