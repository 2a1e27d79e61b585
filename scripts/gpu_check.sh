#!/usr/bin/env bash
# GPU readiness in one command. On a machine with a CUDA GPU: set up .venv, then
#   1. the runtime's test files (tests that do not pin the CPU run on CUDA there: losslessness, sampling, trees),
#   2. plain and speculative decoding of every demo-zoo head on CUDA, each checked token for token against
#      transformers' greedy decoding (scripts/cuda_check.py, float32: half precision rounds the tree's batched
#      verification differently from one-token decoding, so identity is a float32 property),
#   3. the verification-cost curve of a random Llama-3-8B-shaped target at N = 1..64 new tokens, batch 1 and 8
#      (specdec-verify-cost),
#   4. with two GPUs or more, the multi-GPU smoke: the trainers under torchrun on 2 GPUs (NCCL), DDP and FSDP2,
#      GRIFFIN and EAGLE-3, against one process's loss curve and across world sizes (tests/test_parallel_training.py),
# writing everything to bench/results/gpu/<UTC time>/ (or the folder given). On a machine without one it says what
# it would run and exits 0. PYTHON names an interpreter that already has the kit and a CUDA torch (with options if
# any, e.g. "python3 -P" where the kit is on PYTHONPATH): then nothing is set up, for a machine without a registry.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu/$(date -u +%Y%m%dT%H%M%SZ)}
tests=(tests/test_greedy_lossless.py tests/test_sampling_distribution.py tests/test_generation.py tests/test_trees.py
       tests/test_target.py tests/test_eagle3.py tests/test_moa.py tests/test_continuous_batching.py)
read -ra PY <<<"${PYTHON:-.venv/bin/python}"
plan() {
    [ -n "${PYTHON:-}" ] || echo "  bash scripts/setup.sh"
    echo "  ${PY[*]} -m pytest -q ${tests[*]}   (junit report: $out/tests.xml)"
    echo "  ${PY[*]} scripts/cuda_check.py --device cuda --dtype float32 --json $out/zoo_float32.json"
    echo "  ${PY[*]} -m specdec_kit.bench.verify_cost --shape llama3-8b --device cuda --tokens 1-64 --batch 1,8 --out $out"
    echo "  with 2+ GPUs: ${PY[*]} -m pytest -q tests/test_parallel_training.py   (junit report: $out/parallel.xml)"
}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU on this machine (nvidia-smi finds none); on one it would run:"
    plan
    exit 0
fi
[ -n "${PYTHON:-}" ] || bash scripts/setup.sh
if ! "${PY[@]}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: nvidia-smi sees a GPU but ${PY[*]}'s torch has no CUDA ($("${PY[@]}" -c 'import torch; print(torch.__version__)')):" >&2
    echo "  install a CUDA build of torch 2.13.0 there (pip install torch==2.13.0 from PyPI is one), or name another" \
         "interpreter in PYTHON, and run again" >&2
    exit 1
fi
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt"
echo "gpu_check: $(nvidia-smi -L | head -1); results in $out"
status=0
"${PY[@]}" -m pytest -q "${tests[@]}" --junitxml "$out/tests.xml" || status=1
"${PY[@]}" scripts/cuda_check.py --device cuda --dtype float32 --json "$out/zoo_float32.json" || status=1
"${PY[@]}" -m specdec_kit.bench.verify_cost --shape llama3-8b --device cuda --tokens 1-64 --batch 1,8 --out "$out" || status=1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    "${PY[@]}" -m pytest -q tests/test_parallel_training.py --junitxml "$out/parallel.xml" || status=1
else
    echo "gpu_check: one GPU: the multi-GPU training smoke (tests/test_parallel_training.py on 2 GPUs) is left out"
fi
echo "gpu_check: $([ $status = 0 ] && echo 'all passed' || echo 'FAILED (see above)'); results in $out"
exit $status
