#!/usr/bin/env bash
# The README's main job: set up .venv, then speculative generation with every draft type on the
# bundled demo checkpoints, printing the text and the acceptance statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/specdec-generate --demo --demo-dir demo_models "$@"
