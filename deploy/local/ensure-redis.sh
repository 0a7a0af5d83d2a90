#!/usr/bin/env bash
# Install redis-server and redis-cli (Debian packages) when either is missing.
# The tests start their own redis-server processes, so the binaries must exist.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }
if have redis-server && have redis-cli; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure-redis: installing redis-server with apt" >&2
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
have redis-cli || $SUDO apt-get install -y -qq --no-install-recommends redis-tools >/dev/null
if ! { have redis-server && have redis-cli; }; then
  echo "ensure-redis: redis-server/redis-cli still missing after apt-get install" >&2
  exit 1
fi
