"""What an idle instance costs Redis (issue 20: the fleet's fixed load grows with the
number of instances, so it must stay small per instance). Counted by the servers'
own ``INFO commandstats``, on servers of this test's own."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache._fallback import PING_EVERY
from layered_cache._hotreport import HotKeyReporter, fleet_hot_keys
from layered_cache._keys import hot_report_name
from tests.helpers import eventually, make_config
from tests.servers import RedisClusterServers, RedisServer

# Hot-key detection on: its fleet report used to cost every instance a DEL per second.
HOT = {"book": {"key": "book:{id}", "hot": {"replicas": 4, "threshold": "100/s"}}}
WINDOW = 6.0  # seconds of idleness counted


async def _calls(admin: Any) -> dict[str, int]:
    stats = await admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    spent = {name: after[name] - before.get(name, 0) for name in after}
    return {
        name: n
        for name, n in spent.items()
        if n and name not in ("info", "config|resetstat")  # the test's own
    }


async def test_an_idle_instance_sends_redis_about_one_command_a_second(prefix: str) -> None:
    """The backplane's blocking XREAD (one a second), the fallback subscriber's PING
    (one every ``PING_EVERY`` seconds) and, every 30 s, the clock's TIME: nothing else,
    with hot-key detection on and nothing hot."""
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        async with LayeredCache.from_config(make_config(server.url, prefix, HOT)):
            await asyncio.sleep(1.5)  # started: marker, clock, memory policy checked
            before = await _calls(admin)
            await asyncio.sleep(WINDOW)
            spent = _spent(before, await _calls(admin))
        await admin.aclose()
    assert set(spent) <= {"xread", "ping", "time"}, spent
    assert spent.get("xread", 0) <= WINDOW + 1, spent
    assert spent.get("ping", 0) <= WINDOW / PING_EVERY + 1, spent
    assert sum(spent.values()) <= WINDOW + WINDOW / PING_EVERY + 3, spent


async def test_an_idle_instance_on_a_cluster_reads_the_stream_from_its_master_only(
    prefix: str,
) -> None:
    """No ``COMMAND GETKEYS`` before each XREAD (redis-py asked the server where XREAD's
    key is, every time), and the reads go to the master that owns the stream. A cluster
    of its own: on the suite's shared one, listeners other tests left behind read too."""
    with RedisClusterServers(3) as cluster:
        await _idle_on_cluster(cluster, prefix)


async def _idle_on_cluster(redis_cluster: RedisClusterServers, prefix: str) -> None:
    config = make_config(redis_cluster.url, prefix, HOT, redis={"cluster": True, "timeout": "1s"})
    admins = [redis.Redis(host=host, port=port) for host, port in redis_cluster.nodes]
    async with LayeredCache.from_config(config) as cache:
        await asyncio.sleep(1.5)
        before = [await _calls(admin) for admin in admins]
        await asyncio.sleep(WINDOW / 2)
        spent = [_spent(b, await _calls(a)) for a, b in zip(admins, before, strict=True)]
        client = cache._store.client
        owner = client.get_node_from_key(config.redis.prefix + config.backplane.stream)
    for admin in admins:
        await admin.aclose()
    assert not any(name.startswith("command") for node in spent for name in node), spent
    reading = [
        f"{host}:{port}" for (host, port), node in zip(redis_cluster.nodes, spent, strict=True)
        if node.get("xread")
    ]
    assert reading == [f"{owner.host}:{owner.port}"], spent


async def test_the_hot_key_report_is_one_command_a_period_and_none_when_nothing_is_hot(
    prefix: str,
) -> None:
    """One SET with an expiry per report while something is hot (it was DEL + HSET +
    PEXPIRE), one DEL when the last hot key cools down, then nothing; the CLI's reader
    adds the rates up, also from the hash of an instance of the older version."""
    hot: dict[str, dict[str, float]] = {"book": {f"{prefix}book:42": 250.0}}
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        reporter = HotKeyReporter(admin, hot_report_name(prefix, "a"), lambda: hot)
        before = await _calls(admin)
        for _ in range(3):
            await reporter.report_once()
        assert _spent(before, await _calls(admin)) == {"set": 3}
        await admin.hset(hot_report_name(prefix, "old"), f"book\t{prefix}book:42", "50.0")
        fleet = await fleet_hot_keys(admin, prefix)
        assert fleet == {"book": {f"{prefix}book:42": {"rate": 300.0, "instances": 2}}}
        hot = {}
        before = await _calls(admin)
        for _ in range(3):
            await reporter.report_once()
        assert _spent(before, await _calls(admin)) == {"del": 1}
        assert await admin.exists(hot_report_name(prefix, "a")) == 0
        await admin.aclose()


async def test_a_bug_in_one_hot_key_report_does_not_end_the_reports(prefix: str) -> None:
    calls = 0

    def snapshot() -> dict[str, dict[str, float]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the snapshot")
        return {"book": {f"{prefix}book:42": 250.0}}

    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        reporter = HotKeyReporter(admin, hot_report_name(prefix, "a"), snapshot, interval=0.05)
        reporter.start()
        try:
            assert await eventually(lambda: calls >= 2)
            name = hot_report_name(prefix, "a")

            async def reported() -> bool:
                return bool(await admin.exists(name))

            assert await eventually(reported)
        finally:
            await reporter.stop()
            await admin.aclose()


async def test_a_bad_hot_key_report_is_skipped_and_the_others_are_summed(prefix: str) -> None:
    """A report with a rate that is not a number, a field that is not UTF-8, or an
    infinite rate ended `layered-cache hotkeys` with an error (or invalid JSON)."""
    good = {"book": {f"{prefix}book:42": 250.0}}
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        reporter = HotKeyReporter(admin, hot_report_name(prefix, "a"), lambda: good)
        await reporter.report_once()
        await admin.hset(hot_report_name(prefix, "b"), f"book\t{prefix}book:42", "abc")
        await admin.hset(hot_report_name(prefix, "c"), b"\xff\xfe", "5")
        infinite = msgspec.msgpack.encode({f"book\t{prefix}book:42": float("inf")})
        await admin.set(hot_report_name(prefix, "d"), infinite)
        fleet = await fleet_hot_keys(admin, prefix)
        assert fleet == {"book": {f"{prefix}book:42": {"rate": 250.0, "instances": 1}}}
        await admin.aclose()
