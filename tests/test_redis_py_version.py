"""The redis-py floor: pyproject's pin, the runtime check and the oldest version make
test runs all say the same, and an older redis-py is refused up front, naming the fix.

Before the floor was raised to 8.0, the pin said 5.0 and nothing ran anything older
than 8.1: on redis-py 7.4 a cluster waiter's first subscribe raised AttributeError
(asyncio ``PubSub.ssubscribe`` and ``RedisCluster.publish`` arrived in 8.0), and on
5.0 every ``set()`` raised TypeError (``get_connection`` wanted a command name)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from layered_cache import LayeredCache
from layered_cache import _clients as clients
from tests.helpers import make_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", ["7.4.0", "5.0.8", "4.6.0"])
def test_a_redis_py_older_than_the_floor_is_refused_naming_the_fix(version: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        clients.check_redis_py(version)
    assert version in str(caught.value) and "pip install 'redis>=8.0'" in str(caught.value)


@pytest.mark.parametrize("version", ["8.0.0", "8.1.0", "8.10.2", "9.0.0b1", "10.0.0"])
def test_the_floor_and_anything_newer_are_accepted(version: str) -> None:
    clients.check_redis_py(version)


def test_a_cache_on_an_old_redis_py_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str
) -> None:
    monkeypatch.setattr(clients, "redis_py_version", "7.4.0")
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}"}})
    with pytest.raises(RuntimeError, match=re.escape("needs redis-py >= 8.0, found 7.4.0")):
        LayeredCache.from_config(config)


def test_pyproject_pins_the_floor_the_code_checks() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if re.match(r"redis\b", d)]
    assert len(pins) == 1, pins
    floor = re.search(r">=\s*([\d.]+)", pins[0])
    assert floor is not None, pins[0]
    assert tuple(int(p) for p in floor.group(1).split(".")) == clients.MIN_REDIS_PY


def test_make_test_runs_the_smoke_files_on_the_floor_version() -> None:
    makefile = (ROOT / "Makefile").read_text()
    wanted = ".".join(map(str, clients.MIN_REDIS_PY))
    assert f"REDIS_PY_OLDEST := {wanted}.0\n" in makefile
    assert "REDIS_PY_VERSION=$(REDIS_PY_OLDEST)" in makefile


@pytest.mark.parametrize(
    ("version", "turned_off"),
    [("8.0.0", False), ("8.1.0", True), ("8.1.7", True), ("8.2.0", False), ("9.0.0", False)],
)
def test_maintenance_notifications_are_turned_off_only_where_they_skip_the_pool_check(
    version: str, turned_off: bool
) -> None:
    # redis-py 8.1 skipped its pooled-connection check with them on (redis/redis-py#4252);
    # 8.2 fixed it, and users of Redis Enterprise keep its notifications there.
    assert clients._skips_pool_check(version) is turned_off
