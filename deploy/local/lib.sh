# shellcheck shell=bash
# Shared helpers for deploy/local/*.sh (sourced, not run).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RUN="$ROOT/.run"
mkdir -p "$RUN"

# A free TCP port on 127.0.0.1 (the kernel picks it).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# alive PIDFILE: true if the pid in PIDFILE is a running process.
alive() {
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

# port_open HOST PORT: true if something accepts TCP connections there.
port_open() {
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# stop_pidfile PIDFILE: TERM, wait up to 5 s, then KILL the process; remove the file.
stop_pidfile() {
  local pidfile="$1" pid
  if alive "$pidfile"; then
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# env_value FILE VAR: the value of VAR=... in FILE (empty if absent).
env_value() {
  if [ -f "$1" ]; then sed -n "s/^$2=//p" "$1" | tail -n1; fi
}
