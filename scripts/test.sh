#!/usr/bin/env bash
# The README's test command: set up .venv, then run the default test tier (CPU, a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
