#!/usr/bin/env bash
# The README's test command: set up .venv and the guidellm client's .venv-guidellm, then run the default
# test tier (CPU, several minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_guidellm.sh
.venv/bin/python -m pytest "$@"
