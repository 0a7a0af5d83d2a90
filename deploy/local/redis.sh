#!/usr/bin/env bash
# redis.sh start|stop|url - a Redis for the demo/bench, env in .run/redis.env.
# Uses $REDIS_URL when it answers PING; otherwise runs an own redis-server (no
# persistence) on a free port with pid/log under .run/. Idempotent.
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PIDFILE="$RUN/redis.pid"
ENVFILE="$RUN/redis.env"
LOG="$RUN/redis.log"

ping() { [ "$(redis-cli -u "$1" ping 2>/dev/null)" = "PONG" ]; }

start() {
  "$ROOT/deploy/local/ensure-redis.sh"
  if [ -n "${REDIS_URL:-}" ] && ping "$REDIS_URL"; then
    echo "REDIS_URL=$REDIS_URL" >"$ENVFILE"
  elif alive "$PIDFILE" && ping "$(env_value "$ENVFILE" REDIS_URL)"; then
    :  # already running
  else
    stop_pidfile "$PIDFILE"
    local port url
    port="$(free_port)"
    url="redis://127.0.0.1:$port/0"
    mkdir -p "$RUN/redis"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
      --dir "$RUN/redis" --daemonize yes --pidfile "$PIDFILE" --logfile "$LOG"
    for _ in $(seq 100); do ping "$url" && break; sleep 0.1; done
    if ! ping "$url"; then
      echo "redis.sh: redis-server did not answer on $url; log tail:" >&2
      tail -n 20 "$LOG" >&2 || true
      exit 1
    fi
    echo "REDIS_URL=$url" >"$ENVFILE"
  fi
  env_value "$ENVFILE" REDIS_URL
}

case "${1:-}" in
  start) start ;;
  stop) stop_pidfile "$PIDFILE"; rm -f "$ENVFILE" ;;
  url)
    url="$(env_value "$ENVFILE" REDIS_URL)"
    [ -n "$url" ] || { echo "redis.sh: not started (run: $0 start)" >&2; exit 1; }
    echo "$url"
    ;;
  *) echo "usage: $0 start|stop|url" >&2; exit 2 ;;
esac
