#!/usr/bin/env bash
# Install varnishd (Debian package) when missing: tests/test_varnish.py starts its own
# Varnish in front of the bookstore. Never fails the build: if it can't be installed
# (no apt, no root, offline) the Varnish tests are skipped and say why.
set -uo pipefail

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have varnishd; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else
    echo "ensure-varnish: not root and no sudo: the Varnish tests will be skipped" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-varnish: no apt-get: install varnish yourself or the Varnish tests are skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure-varnish: installing varnish with apt" >&2
$SUDO apt-get update -qq || true
# The package's service is not wanted (the tests run varnishd -F themselves).
if ! $SUDO apt-get install -y -qq --no-install-recommends varnish >/dev/null; then
  echo "ensure-varnish: apt-get install varnish failed: the Varnish tests will be skipped" >&2
fi
exit 0
