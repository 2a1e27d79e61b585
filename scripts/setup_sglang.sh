#!/usr/bin/env bash
# Create .venv-sglang (if missing): SGLang's own package, without its CUDA dependencies, beside the pinned CPU
# torch: enough to run SGLang's server-argument code (argument parsing, the resolution pipeline and
# check_server_args) and its model registry, which the SGLang test tier runs on every command the kit and the
# chart write. SGLang's server itself needs its CUDA kernels (sglang-kernel, flashinfer), which are left out.
# It lives in the shared set-up cache (scripts/steps.sh, link_cached_env); a finished install records the hash of its
# inputs in .venv-sglang/.ready, and later runs with the same inputs only point its copy of the kit at this checkout.
# About 2.5 GB (CPU torch, triton, transformers); a few minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECDEC_SGLANG_VENV:-.venv-sglang}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
STEP_PREFIX=setup-sglang
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
link_cached_env "$VENV" sglang scripts/setup_sglang.sh scripts/steps.sh "$SGLANG_SPEC"
if [ "$(cat "$VENV/.ready" 2>/dev/null)" = "$ENV_KEY" ]; then
    LOG=$VENV/setup.log
    point_kit_here "$VENV"
    echo "setup-sglang: $VENV ready ($SGLANG_SPEC)"
    exit 0
fi
cpu_torch_venv "$VENV"
step "installing $SGLANG_SPEC without its CUDA dependencies" "$(venv_python "$VENV")" -m pip install -q --no-deps "$SGLANG_SPEC"
# What sglang.srt.server_args, its resolution pipeline and its model registry import (SGLang's own pins where
# it has them); found by importing them on a CPU machine.
step "installing what SGLang's argument code imports" "$(venv_python "$VENV")" -m pip install -q torch==2.13.0 \
    "transformers==5.19.0" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" compressed-tensors gguf triton \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp \
    dill protobuf
# The kit itself (editable, so it follows this checkout), as the GRIFFIN model package imports it beside SGLang.
point_kit_here "$VENV"
step "checking SGLang's server arguments import" "$VENV/bin/python" -c \
    "from sglang.srt.server_args import prepare_server_args; from sglang.srt.models.registry import ModelRegistry"
echo "$ENV_KEY" >"$VENV/.ready"
echo "setup-sglang: ready ($VENV)"
