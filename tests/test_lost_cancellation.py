"""Background loops end when cancelled, even when redis-py loses the cancellation.

On Python 3.11 a ``cancel()`` that lands as a redis-py read completes can be swallowed
(CPython gh-86296, see ``_clients.resurface_cancel``). A loop that retries Redis
failures then caught the next failure and ran for ever: ``stop()`` gave up on it and
``asyncio.run`` hung at exit (a ``make test-stress`` run timed out so). The client here
turns the cancellation into a lost connection, as that race does; the server is real."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as redis

from layered_cache._backplane import BackplaneListener
from layered_cache._relay import Relay
from layered_cache._relay_upstream import Upstream
from tests.helpers import eventually, make_config


class CancelLosingRedis(redis.Redis):
    """Every command cancelled while it waits fails as a dropped connection instead."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().execute_command(*args, **options)
        except asyncio.CancelledError:
            raise redis.ConnectionError("the cancellation was lost with the read") from None


def alive(name: str) -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks() if task.get_name() == name and not task.done()]


async def test_a_backplane_listener_whose_cancellation_is_lost_still_stops(
    redis_url: str, prefix: str
) -> None:
    client = CancelLosingRedis.from_url(redis_url, socket_timeout=2.0)
    listener = BackplaneListener(
        client, f"{prefix}layered_cache:invalidations", lambda keys: None, lambda: None,
        clock=time.time, block=0.5,
    )
    listener.start()
    assert await asyncio.wait_for(listener.connected.wait(), 10)
    await asyncio.sleep(0.1)  # inside its blocking XREAD
    await listener.stop()
    assert await eventually(lambda: not alive("layered_cache._backplane"), timeout=5)
    await client.aclose()


async def test_a_relay_whose_cancellation_is_lost_still_closes(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, backplane={"block": "500ms"})
    stream = config.redis.prefix + config.backplane.stream
    upstream = Upstream(config.redis, stream, 0.5)
    execute = upstream.execute

    async def losing(*args: Any) -> Any:
        try:
            return await execute(*args)
        except asyncio.CancelledError:
            raise redis.ConnectionError("the cancellation was lost with the read") from None

    upstream.execute = losing  # type: ignore[method-assign]
    relay = Relay(upstream, stream, clock=time.time, block=0.5)
    await relay.start()
    assert await eventually(lambda: relay.status().following)
    await asyncio.sleep(0.1)  # inside its blocking XREAD
    await asyncio.wait_for(relay.close(), 5)  # hung for ever before
    assert not alive("layered_cache._relay")
