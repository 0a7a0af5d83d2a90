"""What counts as "Redis failed": redis-py's errors and timeouts, and an AttributeError
raised inside redis-py (its async cluster client raises one when a connection is torn
down under a command). An AttributeError from anywhere else is a bug: it must surface,
not send every read to the database as if Redis were down.

The torn-down connection is a race inside redis-py that no real server can trigger on
demand, so these tests raise from a function whose module is redis-py's (``exec`` with
its module name): the corner a real server can't reach, as the project rules allow."""

from __future__ import annotations

from typing import Any

import pytest

from layered_cache import LayeredCache
from layered_cache import _direct as direct
from tests.helpers import CountingLoader, make_config


def _raising_in_module(module: str) -> Any:
    namespace: dict[str, Any] = {"__name__": module}
    exec(
        "async def torn_down(*args, **kwargs):\n    return None.writelines([])\n", namespace
    )
    return namespace["torn_down"]


async def test_an_attribute_error_inside_redis_py_is_a_redis_failure(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    loader = CountingLoader("db")
    async with LayeredCache.from_config(config) as cache:
        # A single node's GET goes through _direct (redis-py's pool and connection).
        monkeypatch.setattr(direct, "execute_command", _raising_in_module("redis.asyncio.connection"))
        assert await cache.get_or_load("book", {"id": 1}, loader) == "db"
        assert cache.stats()["book"]["redis_error"] == 1
        assert loader.calls == 1


async def test_an_attribute_error_from_our_own_code_surfaces_as_the_bug_it_is(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    loader = CountingLoader("db")
    async with LayeredCache.from_config(config) as cache:
        monkeypatch.setattr(direct, "execute_command", _raising_in_module("layered_cache._l2"))
        with pytest.raises(AttributeError, match="writelines"):
            await cache.get_or_load("book", {"id": 1}, loader)
        assert cache.stats()["book"]["redis_error"] == 0
        assert cache.redis_status().breaker == "closed"  # no failure was counted
        assert loader.calls == 0
