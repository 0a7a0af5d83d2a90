#!/usr/bin/env bash
# services.sh up|down|env - Redis + Kafka-protocol broker for the demo and benchmarks.
# `up` prints the env (also in .run/*.env, which the Makefile sources).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

case "${1:-}" in
  up)
    echo "REDIS_URL=$("$HERE/redis.sh" start)"
    echo "KAFKA_BOOTSTRAP=$("$HERE/kafka.sh" start)"
    ;;
  down)
    "$HERE/kafka.sh" stop
    "$HERE/redis.sh" stop
    ;;
  env)
    echo "REDIS_URL=$("$HERE/redis.sh" url)"
    echo "KAFKA_BOOTSTRAP=$("$HERE/kafka.sh" bootstrap)"
    ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
