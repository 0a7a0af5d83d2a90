"""What the cache's Redis refuses it for good is said at start, with the fix: an ACL
that refuses what the cache needs, a database the server doesn't have.

set_many, a hot key's set() and replica reservations are MULTI/EXEC on a single node
(``_write_commands``). An ACL that refuses MULTI makes Redis run the commands after it
one by one, not atomically, and set_many then raises NOPERM after its SETs landed: the
cache says so once at start, as an error naming the grant, instead of leaving it to
the first set_many. Each test runs a Redis of its own (ACL users are server-wide)."""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import structlog

from layered_cache import LayeredCache, ReplicaCountMismatch
from layered_cache._invalidation import check_replica_counts
from layered_cache._keys import replica_record_name
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import RedisServer


def _user_url(server: RedisServer, user: str, *rules: str) -> str:
    with redis.Redis.from_url(server.url) as admin:
        admin.execute_command("ACL", "SETUSER", user, "on", ">secret", "~*", "&*", "+@all", *rules)
    parts = urllib.parse.urlsplit(server.url)
    return parts._replace(netloc=f"{user}:secret@{parts.hostname}:{parts.port}").geturl()


@pytest.mark.parametrize(
    ("rules", "refused"),
    [((), False), (("-multi",), True), (("-exec",), True)],
    ids=["all-granted", "no-multi", "no-exec"],
)
async def test_a_user_refused_transactions_is_said_at_start_and_the_cache_still_serves(
    prefix: str, rules: tuple[str, ...], refused: bool
) -> None:
    with RedisServer() as server, structlog.testing.capture_logs() as logs:
        url = _user_url(server, "cache", *rules)
        async with LayeredCache.from_config(make_config(url, prefix)) as cache:
            assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v")) == "v"
            await cache.set("book", {"id": 2}, "w")  # one key: a script, no MULTI
            assert await cache.get("book", {"id": 2}) == "w"
            if refused:
                assert await eventually(
                    lambda: any(e["event"] == "redis_transactions_refused" for e in logs)
                )
            else:  # the check ran (its PING is in the server's stats) and said nothing
                with redis.Redis.from_url(server.url) as admin:
                    assert await eventually(
                        lambda: "cmdstat_exec" in admin.info("commandstats")
                    )
    said = [e for e in logs if e["event"] == "redis_transactions_refused"]
    assert len(said) == (1 if refused else 0)
    if refused:
        assert said[0]["log_level"] == "error" and "+multi +exec" in said[0]["fix"]


async def test_a_database_the_server_does_not_have_is_said_at_start(prefix: str) -> None:
    """``/16`` on a Redis with 16 databases: every command failed, each logged per key,
    nothing was ever cached, and nothing said why. Now one error at start, with the fix
    (the cache still serves, from the loader)."""
    with RedisServer() as server, structlog.testing.capture_logs() as logs:
        url = server.url.rsplit("/", 1)[0] + "/16"
        async with LayeredCache.from_config(make_config(url, prefix)) as cache:
            assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v")) == "v"
            assert await eventually(
                lambda: any(e["event"] == "redis_database_refused" for e in logs)
            )
    said = [e for e in logs if e["event"] == "redis_database_refused"]
    assert len(said) == 1 and said[0]["log_level"] == "error"
    assert "databases" in said[0]["fix"]


def test_a_database_number_no_redis_accepts_is_refused_at_load() -> None:
    from layered_cache import ConfigError, parse_config

    for url in ("redis://h:6379/99999999999999999999", "unix:///tmp/r.sock?db=4294967296"):
        with pytest.raises(ConfigError, match=r"redis\.url: .*(at most|up to) 2147483647"):
            parse_config({"redis": {"url": url}}, env={})


async def test_a_daemon_whose_redis_user_may_not_run_scripts_checks_its_replicas_and_deletes(
    prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """The replica-count check became a script; a daemon whose user may delete but not
    run scripts (it needs none otherwise) took the NOPERM for an outage and retried every
    batch for ever, applying nothing. The check runs with plain commands then."""
    from layered_cache.daemon import Daemon
    from tests.servers import create_topic
    from tests.test_daemon import daemon_config, existing, price_changed, producer

    with RedisServer() as server:
        url = _user_url(server, "invalidator", "-@scripting")
        await create_topic(kafka_bootstrap, unique_topic, 1)
        daemon = Daemon(daemon_config(url, prefix, kafka_bootstrap, unique_topic))
        task = asyncio.create_task(daemon.run())
        client = aioredis.Redis.from_url(server.url)
        key = f"{prefix}book:1"
        try:
            assert await eventually(lambda: bool(daemon.assignment), timeout=20)
            await client.set(key, b"old", ex=600)
            async with producer(kafka_bootstrap) as p:
                await p.send_and_wait(unique_topic, price_changed(1), partition=0)

            async def deleted() -> bool:
                return await existing(client, [key]) == []

            assert await eventually(deleted, timeout=15), daemon.stats.redis_retries
        finally:
            await client.aclose()
            daemon.stop()
            await asyncio.gather(task, return_exceptions=True)


# -- the replica-count check without scripts (plain commands, not in one step) -----------


def _no_scripts(server: RedisServer, user: str = "noscripts", *more: str) -> str:
    return _user_url(server, user, "-@scripting", *more)


async def test_two_script_less_processes_racing_with_other_counts_are_not_both_let_in(
    prefix: str,
) -> None:
    """The other's whole check ran between this one's read and its HSETNX: the HSETNX
    did nothing, unread, and both ran with different counts."""
    with RedisServer() as server:
        url = _no_scripts(server)
        first, second = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
        real_hmget = second.hmget
        try:

            async def hmget_then_the_other_starts(*args: Any, **kwargs: Any) -> Any:
                seen = await real_hmget(*args, **kwargs)  # nothing recorded yet
                await check_replica_counts(first, prefix, {"book": 4})
                return seen

            second.hmget = hmget_then_the_other_starts  # type: ignore[method-assign]
            with pytest.raises(ReplicaCountMismatch):
                await check_replica_counts(second, prefix, {"book": 0})
        finally:
            await first.aclose()
            await second.aclose()


async def test_a_script_less_user_facing_a_record_planted_as_a_string_still_refuses_another_count(
    prefix: str,
) -> None:
    """Only the script replaced a record of another type: the plain path's WRONGTYPE
    read as "Redis unreachable" (a cache starts unchecked, the daemon retried for ever)."""
    with RedisServer() as server:
        url = _no_scripts(server)
        admin = aioredis.Redis.from_url(server.url)
        first, second = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
        try:
            await admin.set(replica_record_name(prefix), "left here by another tool")
            await check_replica_counts(first, prefix, {"book": 4})
            with pytest.raises(ReplicaCountMismatch):
                await check_replica_counts(second, prefix, {"book": 0})
        finally:
            for client in (admin, first, second):
                await client.aclose()


async def test_a_user_that_may_not_run_scripts_nor_write_hashes_is_compared_not_stalled(
    prefix: str,
) -> None:
    """A strict daemon user (DEL, XADD, SET): its HSETNX refused, the check raised, and
    the daemon retried every batch for ever."""
    with RedisServer() as server:
        url = _no_scripts(server, "deleter", "-hsetnx", "-hset")
        owner, deleter = aioredis.Redis.from_url(server.url), aioredis.Redis.from_url(url)
        try:
            await check_replica_counts(owner, prefix, {"book": 0})  # the fleet's record
            await check_replica_counts(deleter, prefix, {"book": 0, "author": 0})
            with pytest.raises(ReplicaCountMismatch):
                await check_replica_counts(deleter, prefix, {"book": 4})
        finally:
            await owner.aclose()
            await deleter.aclose()


async def test_a_script_less_user_that_may_not_run_type_is_still_checked(prefix: str) -> None:
    """The plain path's TYPE (a record of another type is deleted first) was unguarded:
    its NOPERM escaped, and the daemon retried every batch for ever."""
    with RedisServer() as server:
        url = _no_scripts(server, "notype", "-type")
        owner, limited = aioredis.Redis.from_url(server.url), aioredis.Redis.from_url(url)
        try:
            await check_replica_counts(owner, prefix, {"book": 0})  # the fleet's record
            await check_replica_counts(limited, prefix, {"book": 0, "author": 0})
            with pytest.raises(ReplicaCountMismatch):
                await check_replica_counts(limited, prefix, {"book": 4})
        finally:
            await owner.aclose()
            await limited.aclose()
