#!/usr/bin/env bash
# Create .venv-guidellm (if missing): the guidellm benchmark client in a virtualenv of its own (it brings
# uvloop/httptools, which would change the kit's own uvicorn). The third-party client test runs it against
# the kit's server. It lives in the shared set-up cache (scripts/steps.sh, link_cached_env); a finished install
# records the hash of its inputs in .venv-guidellm/.ready, and later runs with the same inputs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_GUIDELLM_VENV:-.venv-guidellm}
SPEC=${GUIDELLM_SPEC:-guidellm==0.8.1}
STEP_PREFIX=setup-guidellm
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
link_cached_env "$VENV" guidellm scripts/setup_guidellm.sh scripts/steps.sh "$SPEC"
[ "$(cat "$VENV/.ready" 2>/dev/null)" = "$ENV_KEY" ] && exit 0
prepare_venv "$VENV"
# guidellm requires torch: pin the CPU wheel so pip does not fetch a CUDA build.
step "installing guidellm with the CPU torch (about a minute)" \
    "$(venv_python "$VENV")" -m pip install -q torch==2.13.0 "$SPEC"
step "checking that guidellm runs" "$VENV/bin/guidellm" --version
echo "$ENV_KEY" >"$VENV/.ready"
echo "setup-guidellm: ready ($VENV)"
