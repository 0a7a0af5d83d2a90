"""The circuit breaker stops each request paying the timeout (DESIGN §6): against a
Redis that accepts connections and never answers, only the calls already sent when it
opened wait out ``redis.timeout``; every call after, queued or new, is refused at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from layered_cache import L2Unavailable, LayeredCache
from tests.helpers import CountingLoader, make_config
from tests.servers import RedisServer

TIMEOUT = 0.2


async def _slowest(calls: list[Awaitable[Any]]) -> float:
    async def timed(call: Awaitable[Any]) -> float:
        started = time.monotonic()
        with contextlib.suppress(L2Unavailable):
            await call
        return time.monotonic() - started

    return max(await asyncio.gather(*(timed(call) for call in calls)))


@pytest.mark.parametrize("operation", ["get_many", "invalidate", "get_or_load"])
async def test_calls_queued_for_a_connection_when_the_breaker_opens_are_refused_at_once(
    redis_server: RedisServer, prefix: str, operation: str
) -> None:
    """40 calls, 4 connections, a frozen Redis: the breaker opened after the first
    round's timeouts, but calls already queued for a connection (past the breaker's
    check) went on to the frozen Redis 4 at a time, the last after 10 timeouts (2 s).
    ``get_or_load`` queues before the check (``Runtime.admission``) and was spared; the
    others now check again once they hold a connection."""
    config = make_config(
        redis_server.url,
        prefix,
        {"book": {"key": "book:{id}"}},
        redis={
            "timeout": f"{TIMEOUT}s",
            "max_connections": 4,
            "breaker": {"failures": 2, "reset": "30s"},
        },
        backplane={"enabled": False},
    )
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 0}, "warm")  # connections made
        redis_server.pause()  # SIGSTOP: accepts connections, never answers
        try:
            calls: list[Awaitable[Any]]
            if operation == "get_many":
                calls = [cache.get_many("book", [{"id": i}]) for i in range(40)]
            elif operation == "invalidate":
                calls = [cache.invalidate("book", {"id": i}) for i in range(40)]
            else:
                calls = [cache.get_or_load("book", {"id": i}, CountingLoader()) for i in range(40)]
            slowest = await _slowest(calls)
            state = cache.redis_status().breaker
        finally:
            redis_server.resume()
    assert state in ("open", "half_open")
    assert slowest < 3 * TIMEOUT  # one timeout, one more for a connection the first held


# -- a namespace whose only Redis step is the announcement (l2 = false) ------------------

_HUNG_TIMEOUT = 0.2


def _l1_only(url: str, prefix: str) -> Any:
    return make_config(
        url,
        prefix,
        {"book": {"key": "book:{id}"}, "session": {"key": "session:{id}", "l2": False}},
        redis={"timeout": f"{_HUNG_TIMEOUT}s", "breaker": {"failures": 2, "reset": "30s"}},
    )


async def _timed_refused_set(cache: LayeredCache) -> float:
    started = time.monotonic()
    with pytest.raises(L2Unavailable, match="set\\(\\) could not announce"):
        await cache.set("session", {"id": 1}, "new")
    return time.monotonic() - started


async def test_set_of_an_l1_only_namespace_is_refused_at_once_while_the_breaker_is_open(
    redis_server: RedisServer, prefix: str
) -> None:
    """Its announcement skipped the breaker: each set() paid the XADD's and the
    PUBLISH's timeouts, with the breaker open."""
    async with LayeredCache.from_config(_l1_only(redis_server.url, prefix)) as cache:
        await cache.set("session", {"id": 0}, "warm")  # connections made
        redis_server.pause()  # SIGSTOP: a hung Redis
        try:
            for i in range(3):  # reads open the breaker
                await cache.get("book", {"id": i})
            assert cache.redis_status().breaker == "open"
            slowest = max([await _timed_refused_set(cache) for _ in range(3)])
        finally:
            redis_server.resume()
    assert slowest < _HUNG_TIMEOUT / 2


async def test_sets_of_an_l1_only_namespace_open_the_breaker_of_a_hung_redis(
    redis_server: RedisServer, prefix: str
) -> None:
    async with LayeredCache.from_config(_l1_only(redis_server.url, prefix)) as cache:
        await cache.set("session", {"id": 0}, "warm")
        redis_server.pause()
        try:
            durations = [await _timed_refused_set(cache) for _ in range(5)]
            state = cache.redis_status().breaker
        finally:
            redis_server.resume()
    assert state == "open"  # failures = 2: the third set() on is refused at once
    assert max(durations[2:]) < _HUNG_TIMEOUT / 2
