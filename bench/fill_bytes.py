"""Scenario 14: bytes moved per fill on 3 masters + 3 replicas, with and without waiters.

What: a Redis Cluster of 3 masters with a replica each (``tests.servers``). Fills of
10 KB values through ``get_or_load`` (L1 off): nobody waiting, then with a second
instance waiting on each fill's lease (50 ms loader), once with large envelopes
announced by an empty message (the default above ``NOTIFY_INLINE_MAX``: the waiter GETs
the value) and once with the envelope sent in the message. Bytes are what the six
server processes wrote (``wchar`` of /proc/PID/io: clients, replication and the cluster
bus; INFO's ``total_net_output_bytes`` leaves the bus out), per byte of value. The
waiter's delay is how long after the winner's return the waiter returned.

Why: a fill is published only when a waiter subscribes on the slot's master, and in a
cluster it is a sharded SPUBLISH, which stays within the slot's shard. Classic PUBLISH
went to every node over the cluster bus, for every fill: measured 7.2x the value bytes
with nobody waiting and 9.1x with a waiter before the change (same machine, same fills).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import median
from bench.report import Headline, Section
from layered_cache import LayeredCache
from layered_cache._l2 import NOTIFY_INLINE_MAX
from layered_cache._wiring import build_parts
from tests.servers import RedisClusterServers

VALUE_BYTES = 10_000
BEFORE = {"nobody waits": 7.24, "a waiter": 9.13}  # classic PUBLISH of every envelope


def _totals(cluster: RedisClusterServers) -> dict[str, int]:
    totals = {"written": 0, "net": 0, "repl": 0}
    for server in cluster.servers:
        client = redis.Redis(host=server.host, port=server.port)
        try:
            info = client.info("stats")
        finally:
            client.close()
        totals["written"] += server.bytes_written()
        totals["net"] += int(info["total_net_output_bytes"])
        totals["repl"] += int(info.get("total_net_repl_output_bytes", 0))
    return totals


async def _idle_bytes_per_second(cluster: RedisClusterServers) -> float:
    """What the six nodes write with no client traffic (the cluster bus's PINGs and
    PONGs, ~150 KB/s here): fills with a waiter take seconds, so this background is a
    visible share of their bytes, more on a slower machine."""
    before, began = _written(cluster), time.monotonic()
    await asyncio.sleep(1.0)
    return (_written(cluster) - before) / (time.monotonic() - began)


def _written(cluster: RedisClusterServers) -> int:
    return sum(server.bytes_written() for server in cluster.servers)


async def _fills(
    cluster: RedisClusterServers, fills: int, waiting: bool, inline_max: int
) -> dict[str, Any]:
    config = make_config(
        cluster.url,
        unique_prefix("fillb"),
        {"book": {"key": "book:{id}", "l1": False}},
        cluster=True,
        backplane=False,
    )
    value = "v" * VALUE_BYTES
    delays: list[float] = []

    async def load() -> str:
        await asyncio.sleep(0.05 if waiting else 0)
        return value

    async def timed(cache: LayeredCache, i: int) -> float:
        await cache.get_or_load("book", {"id": i}, load)
        return time.perf_counter()

    parts = [build_parts(config), build_parts(config)]
    for part in parts:
        part.store.notify_inline_max = inline_max
    async with LayeredCache(config, parts[0]) as a, LayeredCache(config, parts[1]) as b:
        await a.get_or_load("book", {"id": -1}, load)
        idle_rate = await _idle_bytes_per_second(cluster)
        before = await asyncio.to_thread(_totals, cluster)
        began = time.monotonic()
        for i in range(fills):
            if not waiting:
                await a.get_or_load("book", {"id": i}, load)
                continue
            ends = await asyncio.gather(timed(a, i), timed(b, i))
            delays.append(abs(ends[0] - ends[1]))
        await asyncio.sleep(0.5)  # replication and bus messages go out
        after = await asyncio.to_thread(_totals, cluster)
        idle = idle_rate * (time.monotonic() - began)
        waited = a.stats()["book"]["lease_wait_filled"] + b.stats()["book"]["lease_wait_filled"]
    values = fills * VALUE_BYTES
    ratios = {k: (after[k] - before[k]) / values for k in before}
    ratios["less_idle"] = (after["written"] - before["written"] - idle) / values
    return {
        "ratios": ratios,
        "waited": waited,
        "fills": fills,
        "waiter_delay_ms": median(delays) * 1000 if delays else None,
    }


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("fill_bytes", "14. Bytes moved per fill, 3 masters + 3 replicas")
    fills = 200 if env.quick else 2000
    cases = [
        ("nobody waits", False, NOTIFY_INLINE_MAX),
        ("a waiter, value announced (default)", True, NOTIFY_INLINE_MAX),
        ("a waiter, value in the message", True, 10 * VALUE_BYTES),
    ]
    results: dict[str, dict[str, Any]] = {}
    cluster = await asyncio.to_thread(RedisClusterServers(3, replicas=1).start)
    try:
        for name, waiting, inline_max in cases:
            results[name] = await _fills(
                cluster, fills if not waiting else fills // 4, waiting, inline_max
            )
    finally:
        await asyncio.to_thread(cluster.stop)
    section.columns = [
        "case",
        "fills",
        "bytes written / value bytes (6 nodes)",
        "less the bus's idle traffic",
        "INFO net output / value",
        "of which replication",
        "lease waits filled",
        "waiter returns after the winner (median)",
    ]
    for name, r in results.items():
        ratios, delay = r["ratios"], r["waiter_delay_ms"]
        section.rows.append(
            [
                name,
                str(r["fills"]),
                f"{ratios['written']:.2f}x",
                f"{ratios['less_idle']:.2f}x",
                f"{ratios['net']:.2f}x",
                f"{ratios['repl']:.2f}x",
                str(r["waited"]),
                "-" if delay is None else f"{delay:.2f} ms",
            ]
        )
    section.notes += [
        f"Values of {VALUE_BYTES:,} bytes; NOTIFY_INLINE_MAX = {NOTIFY_INLINE_MAX} bytes. "
        f"Before sharded, waiter-only publishing: {BEFORE['nobody waits']}x with nobody "
        f"waiting, {BEFORE['a waiter']}x with a waiter (tests/test_fill_notify.py on the "
        "old code).",
        "A replica's copy of each SET is the floor (about 1x); a cluster bus message "
        "carries a ~2 KB header, which is why small envelopes travel in the message.",
        "The bus's idle traffic (PINGs/PONGs, measured for 1 s before each case, times "
        "the case's duration) is in the raw figure, as it was in the 'before' ones; the "
        "next column takes it out: what the fills themselves cost.",
    ]
    quiet = results["nobody waits"]["ratios"]["written"]
    waiter = results["a waiter, value announced (default)"]["ratios"]["written"]
    waiter_net = results["a waiter, value announced (default)"]["ratios"]["less_idle"]
    section.headline.append(
        Headline(
            "Fill of 10 KB, 3 masters + 3 replicas: bytes moved / value bytes",
            f"{quiet:.2f}x nobody waiting; {waiter:.2f}x with a waiter "
            f"({waiter_net:.2f}x less the bus's idle traffic)",
            f"classic PUBLISH: {BEFORE['nobody waits']}x / {BEFORE['a waiter']}x",
            "< 3x nobody waiting",
            "ok" if quiet < 3 else "MISSED",
        )
    )
    section.data = {"results": results, "before": BEFORE, "value_bytes": VALUE_BYTES}
    section.seconds = time.perf_counter() - started
    return section
