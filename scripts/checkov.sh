#!/usr/bin/env bash
# Put checkov (the policy scanner the chart's tests run) at .tools/checkov/bin/checkov, in a
# venv of its own: its many pinned dependencies stay out of shardflow's. Idempotent. The venv
# lives in a per-user cache named by checkov's version and Python's, and .tools/checkov links
# to it: a fresh clone on the same machine (CI's) does not install it again. Installs hold a
# lock, so two clones never build one venv at once; a working venv is never removed.
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.3.30  # pinned: a new release brings new checks, so a bump is a reviewed change
python=${PYTHON:-python3}
py=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cache=${XDG_CACHE_HOME:-${HOME:+$HOME/.cache}}
cache=${cache:-$PWD/.tools/cache}/shardflow
venv=$cache/checkov-$version-py$py
usable() { "$venv/bin/python" -c '' 2>/dev/null && [ -x "$venv/bin/checkov" ] \
  && [ "$(cat "$venv/.version" 2>/dev/null)" = "$version" ]; }
mkdir -p "$cache" .tools
exec 9>"$cache/checkov.lock"
if command -v flock >/dev/null; then flock 9; fi  # util-linux's; macOS has none
if ! usable; then
  echo "checkov: installing checkov $version into $venv" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "checkov==$version" >"$venv.log" 2>&1 \
    || { tail -n 20 "$venv.log" >&2; exit 1; }
  echo "$version" >"$venv/.version"
  "$venv/bin/checkov" --version >&2
fi
if [ "$(readlink .tools/checkov 2>/dev/null)" != "$venv" ]; then
  rm -rf .tools/checkov
  ln -s "$venv" .tools/checkov
fi
