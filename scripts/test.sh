#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run).
#
#   bash scripts/test.sh [pytest options]         the full run: every tier
#   bash scripts/test.sh --fast [pytest options]  the fast tier: the kit alone, a few minutes on 2 cores
#
# The full run sets up .venv, the guidellm client's .venv-guidellm, vLLM's .venv-vllm, SGLang's .venv-sglang, a
# real Helm CLI in .tools/helm, llama.cpp's tools in .tools/llama.cpp and SpecForge's and speculators' readers in
# .venv-interchange (each reused when its inputs are unchanged:
# scripts/steps.sh), then runs every test: the vLLM tier runs vLLM's server on the zoo's engines, the SGLang tier runs
# SGLang's own argument checks on every command the kit and chart write, the chart tests render and lint with Helm
# itself, the llama.cpp tier runs llama-server on SmolLM2 with the kit's EAGLE-3 head, the interchange tier reads
# hidden states in SpecForge's and speculators' layouts with their own readers, the client tier runs guidellm,
# Locust and schemathesis against the kit's server. A missing tool fails the full run (SPECDEC_REQUIRE_TIERS=1).
# The fast tier sets up .venv alone and leaves out the tiers that need more (markers: tests/tiers.py).
# The tests run in one process per core, at most 4 (pytest-xdist, a test module to a process, the longest modules
# first: tests/schedule.py); SPECDEC_TEST_WORKERS=N sets the number, 0 runs them in this process alone. Processes side
# by side run one thread each (OMP_NUM_THREADS=1; vLLM-CPU unbound, VLLM_CPU_OMP_THREADS_BIND=nobind): the tests'
# tiny models gain nothing from a second thread, and threads of two processes on the same cores only compete.
set -euo pipefail
cd "$(dirname "$0")/.."
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)  # GNU nproc honours OMP_NUM_THREADS
WORKERS_N=${SPECDEC_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}
if ! [[ "$WORKERS_N" =~ ^[0-9]+$ ]]; then
    echo "test.sh: SPECDEC_TEST_WORKERS=$WORKERS_N: expected a whole number of test processes (0: pytest's own)" >&2
    exit 2
fi
WORKERS=()
ONE_THREAD=()  # for the test processes only: the set-up's builds use every core
if [ "$WORKERS_N" -gt 1 ]; then
    WORKERS=(-n "$WORKERS_N" --dist loadfile --no-loadscope-reorder)
    ONE_THREAD=("OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" "VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}")
fi
if [ "${1:-}" = "--fast" ]; then
    shift
    bash scripts/setup.sh
    exec env "${ONE_THREAD[@]}" .venv/bin/python -m pytest "${WORKERS[@]}" -m "not (vllm or sglang or helm or llamacpp or interchange or clients or slow)" "$@"
fi
# llama.cpp's build (minutes of compiling on every core) runs beside the other set-ups, which mostly download and
# unpack wheels: its output is shown once it ends, and the tests start only after both.
# It runs in a process group of its own (job control on for its start), so that a failed set-up stops the compilers too.
LLAMACPP_LOG=$(mktemp)
set -m
bash scripts/setup_llamacpp.sh >"$LLAMACPP_LOG" 2>&1 &
LLAMACPP_PID=$!
set +m
trap 'kill -- -"$LLAMACPP_PID" 2>/dev/null; rm -f "$LLAMACPP_LOG"' EXIT
bash scripts/setup.sh
bash scripts/setup_guidellm.sh
bash scripts/setup_vllm.sh
bash scripts/setup_sglang.sh
bash scripts/setup_helm.sh
bash scripts/setup_interchange.sh
if ! wait "$LLAMACPP_PID"; then
    cat "$LLAMACPP_LOG"
    echo "test.sh: llama.cpp's set-up (scripts/setup_llamacpp.sh) failed" >&2
    exit 1
fi
cat "$LLAMACPP_LOG"
rm -f "$LLAMACPP_LOG"
trap - EXIT
exec env "${ONE_THREAD[@]}" SPECDEC_REQUIRE_TIERS=1 .venv/bin/python -m pytest "${WORKERS[@]}" "$@"
