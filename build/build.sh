#!/usr/bin/env bash
# Build, tag and (with --push) push the kit's images where a Docker engine exists.
#   build/build.sh [cpu|sglang|vllm|tensorrt-llm|all] [--registry REG] [--tag TAG] [--push] [--build-arg K=V ...]
set -euo pipefail
cd "$(dirname "$0")/.."
targets=()
registry="" tag="$(python3 -c 'import re;print(re.search(r"^version = \"(.+)\"", open("pyproject.toml").read(), re.M).group(1))')"
push=0
build_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    cpu|sglang|vllm|tensorrt-llm) targets+=("$1") ;;
    all) targets+=(cpu sglang vllm tensorrt-llm) ;;
    --registry) registry="${2%/}/"; shift ;;
    --tag) tag="$2"; shift ;;
    --push) push=1 ;;
    --build-arg) build_args+=(--build-arg "$2"); shift ;;
    -h|--help) sed -n 2,3p "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=(cpu)
if ! docker info >/dev/null 2>&1; then
  echo "error: no Docker engine is reachable (docker info failed); run this where one exists" >&2
  exit 1
fi
for target in "${targets[@]}"; do
  image="${registry}specdec:${tag}-${target}"
  echo "building ${image} from build/${target}.Dockerfile"
  docker build -f "build/${target}.Dockerfile" --build-arg "VERSION=${tag}" "${build_args[@]}" -t "${image}" .
  if [ "$push" = 1 ]; then
    docker push "${image}"
  fi
done
