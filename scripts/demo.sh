#!/usr/bin/env bash
# The README's main job: set up .venv, then speculative generation with every draft type on the
# committed demo model zoo (zoo/), printing the text and the acceptance statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/specdec-generate --zoo zoo "$@"
