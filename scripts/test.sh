#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run).
#
#   bash scripts/test.sh [pytest options]         the full run: every tier
#   bash scripts/test.sh --fast [pytest options]  the fast tier: the kit alone, a few minutes on 2 cores
#
# The full run sets up .venv, the guidellm client's .venv-guidellm, vLLM's .venv-vllm, SGLang's .venv-sglang, a
# real Helm CLI in .tools/helm and llama.cpp's tools in .tools/llama.cpp (each reused when its inputs are unchanged:
# scripts/steps.sh), then runs every test: the vLLM tier runs vLLM's server on the zoo's engines, the SGLang tier runs
# SGLang's own argument checks on every command the kit and chart write, the chart tests render and lint with Helm
# itself, the llama.cpp tier runs llama-server on SmolLM2 with the kit's EAGLE-3 head, the client tier runs guidellm,
# Locust and schemathesis against the kit's server. A missing tool fails the full run (SPECDEC_REQUIRE_TIERS=1).
# The fast tier sets up .venv alone and leaves out the tiers that need more (markers: tests/tiers.py).
# SPECDEC_TEST_WORKERS=N runs the tests in N processes (pytest-xdist, a test module to a process); the default, 0, is
# one process: on 2 cores two processes ran the full run slower (they compete for the same cores), so it pays only
# on a machine with more of them.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=()
if [ "${SPECDEC_TEST_WORKERS:-0}" != 0 ]; then
    WORKERS=(-n "$SPECDEC_TEST_WORKERS" --dist loadfile)
fi
if [ "${1:-}" = "--fast" ]; then
    shift
    bash scripts/setup.sh
    exec .venv/bin/python -m pytest "${WORKERS[@]}" -m "not (vllm or sglang or helm or llamacpp or clients or slow)" "$@"
fi
bash scripts/setup.sh
bash scripts/setup_guidellm.sh
bash scripts/setup_vllm.sh
bash scripts/setup_sglang.sh
bash scripts/setup_helm.sh
bash scripts/setup_llamacpp.sh
SPECDEC_REQUIRE_TIERS=1 exec .venv/bin/python -m pytest "${WORKERS[@]}" "$@"
