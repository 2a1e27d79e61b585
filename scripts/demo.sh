#!/usr/bin/env bash
# The README's main job: set up .venv, build the default engine (GRIFFIN on the demo zoo, ONNX Runtime),
# generate with it next to plain decoding, then run every draft type on the committed demo model zoo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python export/build_engine.py --draft griffin
.venv/bin/specdec-generate --engine engines/griffin-onnxruntime --compare-plain
.venv/bin/specdec-generate --zoo zoo "$@"
