#!/usr/bin/env bash
# The demo: run examples/thumbnails.json end to end on local RabbitMQ + Redis and show its result.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/bootstrap.sh
export SHARDFLOW_PREFIX=${SHARDFLOW_PREFIX:-demo}
export SHARDFLOW_LOG_LEVEL=${SHARDFLOW_LOG_LEVEL:-WARNING}

.venv/bin/shardflow dev --app examples.tasks &
dev=$!
trap 'kill -TERM $dev 2>/dev/null; wait $dev 2>/dev/null || true' EXIT

input='{"album": "holiday"}'
echo "demo: submitting examples/thumbnails.json" >&2
id=$(.venv/bin/shardflow submit examples/thumbnails.json --input "$input")
echo "demo: workflow $id" >&2
# The same program and input under the same id: no second run, its result when it ends.
result=$(.venv/bin/shardflow submit examples/thumbnails.json --input "$input" --id "$id" --wait --timeout 60)
echo "demo: status:" >&2
.venv/bin/shardflow status "$id"
echo "demo: result: $result"
