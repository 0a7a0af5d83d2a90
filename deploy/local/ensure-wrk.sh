#!/usr/bin/env bash
# Install wrk (Debian package) when missing: `make bench`'s e2e_wrk scenario drives the
# bookstore with it. Never fails the run: without wrk that scenario reports why it
# could not run, and the others go on.
exec "$(dirname "${BASH_SOURCE[0]}")/ensure-apt.sh" ensure-wrk wrk wrk "the e2e_wrk benchmark"
