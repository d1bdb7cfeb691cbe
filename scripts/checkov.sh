#!/usr/bin/env bash
# Put checkov (the policy scanner the chart's tests run) at .tools/checkov/bin/checkov, in a
# venv of its own: its many pinned dependencies stay out of shardflow's. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.3.30  # pinned: a new release brings new checks, so a bump is a reviewed change
venv=.tools/checkov
if [ -x "$venv/bin/checkov" ] && [ "$(cat "$venv/.version" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
python=${PYTHON:-python3}
echo "checkov: installing checkov $version into $venv" >&2
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q "checkov==$version" >"$venv.log" 2>&1 \
  || { tail -n 20 "$venv.log" >&2; exit 1; }
echo "$version" >"$venv/.version"
"$venv/bin/checkov" --version >&2
