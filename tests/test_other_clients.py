"""What other clients of the same Redis do to the names and connections the cache owns:
another client's tracking redirect aimed at a pub/sub connection of ours, keys of ours
replaced with another type. Each once stopped a part of the cache for good (found by a
review against Redis 7 and Valkey 9, 2026-12-05)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis.asyncio as aioredis

from layered_cache import LayeredCache, ReplicaCountMismatch
from layered_cache._keys import replica_record_name, tag_version_name
from tests.helpers import CountingLoader, eventually, in_l1, make_config
from tests.servers import RedisServer

_PLAIN = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
_TAGGED = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}, "tags": True}}
HOT = {"book": {"key": "book:{id}", "hot": {"replicas": 4}}}


def _command(sock: socket.socket, *args: str) -> bytes:
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    sock.sendall(payload.encode())
    return sock.recv(65536)


async def test_a_tracking_redirect_to_the_fallback_subscriber_does_not_end_it(
    redis_server: RedisServer, prefix: str
) -> None:
    url = f"redis://{redis_server.host}:{redis_server.port}/0?protocol=2"
    config = make_config(url, prefix, _PLAIN, backplane={"block": "200ms"})
    admin = aioredis.from_url(url)
    tracker = socket.create_connection((redis_server.host, redis_server.port))
    try:
        async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
            assert a._fallback is not None and b._fallback is not None
            assert await eventually(b._fallback.subscribed.is_set)
            assert await eventually(a._fallback.subscribed.is_set)

            # Every connection in pub/sub mode (the two fallback subscribers; no fill
            # waiter is subscribed now) becomes a tracking client's redirect target.
            clients = (await admin.execute_command("CLIENT", "LIST")).decode()
            pubsub_ids = [
                line.split("id=")[1].split()[0]
                for line in clients.splitlines()
                if " sub=1 " in f" {line} " or "flags=P" in line
            ]
            assert pubsub_ids, clients
            for client_id in pubsub_ids:
                await asyncio.to_thread(
                    _command, tracker, "CLIENT", "TRACKING", "ON", "REDIRECT", client_id, "BCAST"
                )
                await asyncio.to_thread(_command, tracker, "SET", f"{prefix}unrelated", "1")
                await asyncio.to_thread(_command, tracker, "CLIENT", "TRACKING", "OFF")
            await asyncio.sleep(0.5)

            fallback = b._fallback
            assert fallback._task is not None
            assert not fallback._task.done(), (
                f"B's fallback subscriber ended: {fallback._task.exception()!r}"
            )

            # And it still does its job: the stream refuses appends (another client
            # made its name a string), A's invalidation goes over pub/sub, B drops L1.
            await b.get_or_load("book", {"id": 2}, CountingLoader("old"))
            assert in_l1(b, 2)
            stream = prefix + config.backplane.stream
            await admin.delete(stream)
            await admin.set(stream, "not a stream")
            await a.invalidate("book", {"id": 2})
            assert await eventually(lambda: not in_l1(b, 2), timeout=3), (
                "B kept book 2 in L1 after A's fallback announcement: its subscriber is gone"
            )
    finally:
        tracker.close()
        await admin.aclose()


async def _plant(admin: aioredis.Redis, name: str, kind: str) -> None:
    if kind == "hash":
        await admin.hset(name, "field", "value")
    elif kind == "list":
        await admin.rpush(name, "a")
    elif kind == "set":
        await admin.sadd(name, "a")
    elif kind == "stream":
        await admin.xadd(name, {"f": "v"})


@pytest.mark.parametrize("kind", ["hash", "list", "set", "stream"])
async def test_a_tag_whose_version_key_holds_another_type_is_still_cached_and_writable(
    redis_url: str, prefix: str, kind: str
) -> None:
    config = make_config(redis_url, prefix, _TAGGED)
    admin = aioredis.from_url(redis_url)
    try:
        await _plant(admin, tag_version_name(prefix, "shelf"), kind)
        async with LayeredCache.from_config(config) as cache:
            # A writer: refused for good today (L2Unavailable: WRONGTYPE).
            await cache.set("book", {"id": 2}, "written", tags=["shelf"])

            loader = CountingLoader("loaded")
            assert await cache.get_or_load("book", {"id": 1}, loader, tags=["shelf"]) == "loaded"
            assert await cache.get_or_load("book", {"id": 1}, loader, tags=["shelf"]) == "loaded"
            assert loader.calls == 1, (
                f"every get_or_load of a tag whose version key is a {kind} went to the "
                f"loader ({loader.calls} loads): nothing was cached"
            )
    finally:
        await admin.aclose()


async def test_a_replica_record_planted_as_a_string_still_refuses_another_count(
    redis_url: str, prefix: str
) -> None:
    admin = aioredis.from_url(redis_url)
    try:
        await admin.set(replica_record_name(prefix), "left here by another tool")
        hot = make_config(redis_url, prefix, HOT)  # book: 4 replicas
        plain = make_config(redis_url, prefix)  # book: 0 replicas
        async with LayeredCache.from_config(hot):
            with pytest.raises(ReplicaCountMismatch):
                async with LayeredCache.from_config(plain):
                    pass
    finally:
        await admin.aclose()
