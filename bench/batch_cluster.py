"""Scenario 11: ``get_many`` of 50 keys on a 3-master Redis Cluster: round trips per master.

What: 50 warm keys (L1 off) spread over the masters of the cluster started by
``tests.servers.RedisClusterServers``; one ``get_many`` of all 50, with every
``send_packed_command`` of a ``redis.asyncio`` connection counted per node
(``bench/sends.py``: a pipeline is one send per node, so sends are round trips).
Also timed, as information: ``get_many`` against the floor of a raw
``RedisCluster.mget_nonatomic`` + ``msgspec`` decode of the same keys, and against 50
sequential ``get`` calls.

Why: in a cluster the 50 keys live in ~50 slots on every master; a batch must cost one
round trip per master (sent concurrently), not one per slot or per key.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import redis
import redis.asyncio as aioredis

from bench.batch import KEYS, mget_floor
from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import Batch, book_value, fmt_ratio, fmt_us, interleaved, median
from bench.report import Headline, Section
from bench.sends import count_sends
from layered_cache import LayeredCache

FLOOR = "floor: RedisCluster mget_nonatomic of 50 + msgspec decode of each"
OURS = "layered_cache get_many(50) (L2 hits, L1 off)"
SEQUENTIAL = "50 sequential layered_cache get (L2 hits, L1 off)"


class _ClusterMget:
    """``mget`` as ``mget_nonatomic``: the floor helper calls ``client.mget``."""

    def __init__(self, client: Any) -> None:
        self.mget = client.mget_nonatomic


def _owners(cluster: Any, keys: list[str]) -> Counter[str]:
    client = redis.RedisCluster.from_url(cluster.url)
    try:
        return Counter(
            f"{node.host}:{node.port}" for node in (client.get_node_from_key(k) for k in keys)  # type: ignore[no-untyped-call]
        )
    finally:
        client.close()


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("batch_cluster", "11. get_many of 50 keys on a 3-master Redis Cluster")
    try:
        cluster = await asyncio.to_thread(env.cluster)
    except Exception as exc:
        section.error = f"no cluster: {type(exc).__name__}: {exc}"
        section.headline.append(Headline("Cluster get_many of 50: round trips per master", "n/a",
                                         "", "<= 1 per master", "n/a"))
        section.seconds = time.perf_counter() - started
        return section
    prefix = unique_prefix("batchc")
    n, repeats = (100, 3) if env.quick else (500, 7)
    config = make_config(cluster.url, prefix, {"book": {"key": "book:{id}", "l1": False}},
                         cluster=True, backplane=False)
    fields = [{"id": i} for i in range(KEYS)]
    raw = aioredis.RedisCluster.from_url(cluster.url)
    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [(f, book_value(f["id"])) for f in fields])
        keys = [cache.key("book", f) for f in fields]
        owners = await asyncio.to_thread(_owners, cluster, keys)
        slots = len({redis.crc.key_slot(k.encode()) for k in keys})
        await cache.get_many("book", fields)  # connections to every master made
        await raw.mget_nonatomic(keys)
        rounds: list[Counter[str]] = []
        for _ in range(5):
            with count_sends() as sends:
                values = await cache.get_many("book", fields)
            rounds.append(Counter(sends))
        assert values == [book_value(i) for i in range(KEYS)]

        async def ours(count: int) -> float:
            start = time.perf_counter()
            for _ in range(count):
                await cache.get_many("book", fields)
            return (time.perf_counter() - start) / count

        async def sequential(count: int) -> float:
            start = time.perf_counter()
            for _ in range(count):
                for f in fields:
                    await cache.get("book", f)
            return (time.perf_counter() - start) / count

        contenders: dict[str, Batch] = {FLOOR: mget_floor(_ClusterMget(raw), keys), OURS: ours,
                                        SEQUENTIAL: sequential}
        results = await interleaved(contenders, n, repeats, batch_seconds=0.25)
        await raw.delete(*keys)
    await raw.aclose()

    per_master = rounds[0]
    worst = max(max(r.values()) for r in rounds)
    masters = len(cluster.nodes)
    section.columns = ["master", "keys of the 50 it owns", "round trips in one get_many (5 calls)"]
    for node in sorted(owners):
        section.rows.append([node, str(owners[node]), ", ".join(str(r[node]) for r in rounds)])
    medians = {name: median(values) for name, values in results.items()}
    floor = medians[FLOOR]
    timing = "; ".join(f"{name}: {fmt_us(medians[name])} ({fmt_ratio(medians[name], floor)})"
                       for name in results)
    section.notes += [
        f"The 50 keys fall into {slots} slots on {len(owners)} of {masters} masters; "
        f"one get_many sent {sum(per_master.values())} round trips in all, at most {worst} "
        "to any master (client-side sends of `redis.asyncio` connections, `bench/sends.py`).",
        f"Timing (information, median of {repeats} interleaved repeats): {timing}.",
    ]
    ours_s = medians[OURS]
    section.headline.append(Headline(
        "Cluster get_many of 50 (3 masters, L1 off): round trips per master",
        f"{worst} per master ({sum(per_master.values())} in all; {fmt_us(ours_s)}, "
        f"{ours_s / floor:.2f}x floor)",
        f"{slots} slots; mget_nonatomic+decode {fmt_us(floor)}; 50 gets {fmt_us(medians[SEQUENTIAL])}",
        "<= 1 per master", "ok" if worst <= 1 and len(per_master) <= masters else "MISSED",
    ))
    section.data = {"owners": dict(owners), "slots": slots,
                    "round_trips_per_call": [dict(r) for r in rounds],
                    "median_s": medians, "repeats_s": results}
    section.seconds = time.perf_counter() - started
    return section
