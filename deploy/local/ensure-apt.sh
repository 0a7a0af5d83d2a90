#!/usr/bin/env bash
# ensure-apt.sh NAME PACKAGE BINARY WHAT: install the Debian PACKAGE when BINARY is missing
# (on PATH or in /usr/sbin). Never fails the build: if it can't be installed (no apt, no
# root, offline) it says that WHAT will be skipped, and the caller goes on.
# Used by ensure-varnish.sh (make test) and ensure-wrk.sh (make bench).
set -uo pipefail
name=$1 package=$2 binary=$3 what=$4

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have "$binary"; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else
    echo "$name: not root and no sudo: $what will be skipped" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "$name: no apt-get: install $package yourself or $what will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "$name: installing $package with apt" >&2
$SUDO apt-get update -qq || true
# --no-install-recommends: no package services are wanted (the tests run varnishd -F).
if ! $SUDO apt-get install -y -qq --no-install-recommends "$package" >/dev/null; then
  echo "$name: apt-get install $package failed: $what will be skipped" >&2
fi
exit 0
