#!/usr/bin/env bash
# Install varnishd (Debian package) when missing: tests/test_varnish.py starts its own
# Varnish in front of the bookstore. Never fails the build: if it can't be installed
# (no apt, no root, offline) the Varnish tests are skipped and say why.
exec "$(dirname "${BASH_SOURCE[0]}")/ensure-apt.sh" ensure-varnish varnish varnishd "the Varnish tests"
