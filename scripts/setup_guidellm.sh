#!/usr/bin/env bash
# Create .venv-guidellm (if missing): the guidellm benchmark client in a virtualenv of its own (it brings
# uvloop/httptools, which would change the kit's own uvicorn). The third-party client test runs it against
# the kit's server. A finished install records its requirement in .venv-guidellm/.ready; later runs with the
# same one return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_GUIDELLM_VENV:-.venv-guidellm}
SPEC=${GUIDELLM_SPEC:-guidellm==0.8.1}
[ "$(cat "$VENV/.ready" 2>/dev/null)" = "$SPEC" ] && exit 0
STEP_PREFIX=setup-guidellm
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
prepare_venv "$VENV"
# guidellm requires torch: pin the CPU wheel so pip does not fetch a CUDA build.
step "installing guidellm with the CPU torch (about a minute)" \
    "$VENV/bin/python" -m pip install -q torch==2.13.0 "$SPEC"
step "checking that guidellm runs" "$VENV/bin/guidellm" --version
echo "$SPEC" >"$VENV/.ready"
echo "setup-guidellm: ready ($VENV)"
