"""Fill notifications: a lease waiter is woken by the winner's fill, and a fill costs
about its value in bytes, not a copy per cluster node.

The waiters here re-read L2 only every 20 s (``reread_pause``), so a waiter answered
within seconds was woken by the notification itself. Small envelopes travel in the
message; large ones (over ``NOTIFY_INLINE_MAX``) are announced by an empty message and
the waiter GETs them. In a cluster the channel is sharded (SSUBSCRIBE on the slot's
master, SPUBLISH in the fill script), so the bytes test runs a 3 masters + 3 replicas
cluster, where classic PUBLISH reached all 6 nodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from layered_cache import Config, LayeredCache
from layered_cache._l2 import NOTIFY_INLINE_MAX
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import RedisClusterServers

SMALL = "s" * 100
LARGE = "L" * (NOTIFY_INLINE_MAX * 5)
VALUE_BYTES = 10_000


@pytest.fixture(scope="module")
def cluster_with_replicas() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(3, replicas=1) as cluster:
        yield cluster


def _config(url: str, prefix: str, cluster: bool) -> Config:
    stampede = {"reread_pause": ["20s", "20s"], "max_wait": "15s"}
    namespaces = {"book": {"key": "book:{id}", "l1": False, "stampede": stampede}}
    redis = {"cluster": cluster, "timeout": "2s", "connect_timeout": "2s"}
    return make_config(url, prefix, namespaces, redis=redis, backplane={"enabled": False})


async def _waiter_is_woken(config: Config, value: str, batch: bool = False) -> None:
    release = asyncio.Event()
    loader = CountingLoader(value)

    async def held() -> Any:
        await release.wait()
        return await loader()

    async def held_many(fields: list[dict[str, object]]) -> list[Any]:
        return [await held() for _ in fields]

    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        if batch:  # the batch fill runs the same script, with the same arguments
            winner = asyncio.create_task(_first(a.get_or_load_many("book", [{"id": 1}], held_many)))
        else:
            winner = asyncio.create_task(a.get_or_load("book", {"id": 1}, held))
        assert await eventually(lambda: a.stats()["book"]["lease_won"] == 1, timeout=10)
        waiter = asyncio.create_task(b.get_or_load("book", {"id": 1}, held))
        assert await eventually(lambda: b.stats()["book"]["lease_lost"] == 1, timeout=10)
        await asyncio.sleep(0.3)  # let the waiter's subscription be confirmed (best effort)
        release.set()
        # Well before its first re-read (20 s): only the notification can wake it.
        assert await asyncio.wait_for(waiter, 8) == value
        assert await winner == value
        assert loader.calls == 1 and b.stats()["book"]["lease_wait_filled"] == 1


async def _first(values: Any) -> Any:
    return (await values)[0]


@pytest.mark.parametrize("value", [SMALL, LARGE], ids=["inline", "announced"])
async def test_a_waiter_on_one_node_is_woken_by_the_fill(
    redis_url: str, prefix: str, value: str
) -> None:
    await _waiter_is_woken(_config(redis_url, prefix, cluster=False), value)


@pytest.mark.parametrize("value", [SMALL, LARGE], ids=["inline", "announced"])
async def test_a_waiter_is_woken_by_a_batch_fill_too(redis_url: str, prefix: str, value: str) -> None:
    # The batch fill once passed the script too few arguments: with a waiter subscribed
    # the script failed, the value was never written and the waiter slept to its re-read.
    await _waiter_is_woken(_config(redis_url, prefix, cluster=False), value, batch=True)


@pytest.mark.cluster
@pytest.mark.parametrize("value", [SMALL, LARGE], ids=["inline", "announced"])
async def test_a_waiter_in_a_cluster_is_woken_by_the_sharded_fill(
    redis_cluster: Any, prefix: str, value: str
) -> None:
    await _waiter_is_woken(_config(redis_cluster.url, prefix, cluster=True), value)


def _written(cluster: RedisClusterServers) -> int:
    return sum(server.bytes_written() for server in cluster.servers)


async def _bytes_per_value_byte(
    cluster: RedisClusterServers, prefix: str, fills: int, waiting: bool
) -> float:
    """Bytes all 6 nodes wrote for ``fills`` fills of 10 KB, per byte of value; with
    ``waiting``, a second instance waits on each fill's lease."""
    config = _config(cluster.url, prefix, cluster=True)
    value = "v" * VALUE_BYTES
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        await a.get_or_load("book", {"id": -1}, CountingLoader(value))  # connections made
        idle_rate = await _idle_bytes_per_second(cluster)
        started, before = time.monotonic(), _written(cluster)
        for i in range(fills):
            if waiting:
                loader = CountingLoader(value, delay=0.05)
                field = {"id": i}
                await asyncio.gather(
                    a.get_or_load("book", field, loader), b.get_or_load("book", field, loader)
                )
            else:
                await a.get_or_load("book", {"id": i}, CountingLoader(value))
        await asyncio.sleep(0.5)  # the replication stream and bus messages go out
        idle = idle_rate * (time.monotonic() - started)
        return (_written(cluster) - before - idle) / (fills * VALUE_BYTES)


async def _idle_bytes_per_second(cluster: RedisClusterServers) -> float:
    """What the nodes write with no client traffic: the cluster bus's PINGs and PONGs
    (about 2 KB each, several per node per second). The waiting fills take seconds (a
    50 ms load each), and on a busy machine longer: uncounted, this background was
    enough to push the ratio past its bound (5.34, seen on CI)."""
    before, started = _written(cluster), time.monotonic()
    await asyncio.sleep(1.0)
    return (_written(cluster) - before) / (time.monotonic() - started)


@pytest.mark.cluster
async def test_fills_nobody_waits_for_cost_about_their_value_on_3_masters_3_replicas(
    cluster_with_replicas: RedisClusterServers, prefix: str
) -> None:
    # Was 7.2x: the whole envelope PUBLISHed to all 6 nodes over the cluster bus, on
    # top of the replication of the SET. Now about 1.0x: the SET to the replica, and
    # nothing else (the bus's own background traffic is not counted).
    ratio = await _bytes_per_value_byte(cluster_with_replicas, prefix, 300, waiting=False)
    assert ratio < 2.0, f"{ratio:.2f} bytes written per byte of value"


@pytest.mark.cluster
async def test_fills_with_a_waiter_stay_within_their_shard(
    cluster_with_replicas: RedisClusterServers, prefix: str
) -> None:
    # Was 9.1x (the broadcast plus the waiter's copy); now about 2.2x: the replica's
    # copy, the waiter's GET, a small SPUBLISH within the slot's shard.
    ratio = await _bytes_per_value_byte(cluster_with_replicas, prefix, 100, waiting=True)
    assert ratio < 3.5, f"{ratio:.2f} bytes written per byte of value"
