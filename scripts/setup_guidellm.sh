#!/usr/bin/env bash
# Create .venv-guidellm (if missing): the guidellm benchmark client in a virtualenv of its own (it brings
# uvloop/httptools, which would change the kit's own uvicorn). The third-party client test runs it against
# the kit's server. A finished install leaves .venv-guidellm/.ready, so later runs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_GUIDELLM_VENV:-.venv-guidellm}
[ -f "$VENV/.ready" ] && exit 0
PYTHON=${PYTHON:-python3}
mkdir -p "$VENV"
LOG=$VENV/setup.log
STEP_PREFIX=setup-guidellm
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
: >"$LOG"
# guidellm requires torch: pin the CPU wheel so pip does not fetch a CUDA build.
step "installing guidellm with the CPU torch (about a minute)" \
    "$VENV/bin/python" -m pip install -q torch==2.13.0 "${GUIDELLM_SPEC:-guidellm==0.8.1}"
step "checking that guidellm runs" "$VENV/bin/guidellm" --version
touch "$VENV/.ready"
echo "setup-guidellm: ready ($VENV)"
