#!/usr/bin/env bash
# Install wrk (Debian package) when missing: `make bench`'s e2e_wrk scenario drives the
# bookstore with it. Never fails the run: without wrk that scenario reports why it
# could not run, and the others go on.
set -uo pipefail

if command -v wrk >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else
    echo "ensure-wrk: not root and no sudo: the e2e_wrk benchmark will be skipped" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-wrk: no apt-get: install wrk yourself or the e2e_wrk benchmark is skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure-wrk: installing wrk with apt" >&2
$SUDO apt-get update -qq || true
$SUDO apt-get install -y -qq --no-install-recommends wrk >/dev/null ||
  echo "ensure-wrk: apt-get install wrk failed: the e2e_wrk benchmark will be skipped" >&2
exit 0
