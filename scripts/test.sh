#!/usr/bin/env bash
# The test command: services, venv, helm, lint, then the whole suite on real RabbitMQ and Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/bootstrap.sh
bash scripts/helm.sh  # for the chart's tests
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
