#!/usr/bin/env bash
# Make sure Python >= 3.11, Redis and RabbitMQ are installed and running on 127.0.0.1.
# Idempotent: installs with apt-get only what is missing, starts only what is down.
set -euo pipefail

log() { echo "services: $*" >&2; }

missing=()
python_ok() { "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
python_ok "${PYTHON:-python3}" || missing+=(python3 python3-venv)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v rabbitmq-server >/dev/null || missing+=(rabbitmq-server)
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

port_open() { timeout 1 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }

wait_for() {  # wait_for NAME PORT SECONDS
  local deadline=$((SECONDS + $3))
  until port_open "$2"; do
    if ((SECONDS > deadline)); then log "$1 did not open port $2 in $3s"; return 1; fi
    sleep 0.5
  done
}

if ! port_open 6379; then
  log "starting redis-server"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/shardflow.log
  wait_for redis 6379 30
fi

if ! port_open 5672; then
  log "starting rabbitmq-server"
  rabbitmq-server -detached
  rabbitmqctl -q await_startup --timeout 120 >/dev/null 2>&1 || true
  wait_for rabbitmq 5672 120
fi
log "redis and rabbitmq are up"
