#!/usr/bin/env bash
# The test command: services, venv, lint, then the whole test suite on real RabbitMQ and Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
