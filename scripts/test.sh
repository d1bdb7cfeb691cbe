#!/usr/bin/env bash
# The test command: services, venv, helm, lint, then the whole suite on real RabbitMQ and Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/bootstrap.sh
bash scripts/helm.sh  # for the chart's tests
bash scripts/podman.sh >/dev/null  # podman and a local base image, for the image's test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
