"""A Redis Cluster master fails over (3 masters + 1 replica each, SIGKILL): no request
stalls past the configured timeout, keys on healthy masters stay in L2, and the dead
master's breaker disappears with it from the slot map (issue 21, items 4 and 6)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from redis.crc import key_slot
from redis.exceptions import RedisError

from layered_cache import L2Unavailable, LayeredCache
from tests.helpers import Starvation, eventually, make_config
from tests.servers import RedisClusterServers, RedisServer

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KEYS = 300
TIMEOUT = 0.2  # redis.timeout
# The bound is the timeout plus one breaker decision; the margin is for a busy machine
# (2 shared cores). Before the fix a failover stalled calls for 2-4 s.
BOUND = TIMEOUT + 1.0
# A healthy key's load is the OS's doing, not the failover's, when the process was starved
# just before it: one stall past the timeout fails every read in flight, the healthy
# master's breaker opens after 3 of them and sends its reads to the loader for its
# `reset` (1 s, redis.breaker's default). A stall shorter than this cannot time a read out.
STALL = TIMEOUT / 4
STALL_SHADOW = 1.0 + TIMEOUT + 0.5  # breaker reset + the read that failed + a margin


@dataclass
class Observed:
    worst_get: float = 0.0  # wall latency, less the starvation that overlapped it
    worst_invalidate: float = 0.0
    raw_worst: float = 0.0  # wall latency as measured
    reads: int = 0
    loads: dict[str, int] = field(default_factory=lambda: {"healthy": 0, "dead": 0})
    healthy_loads_at: list[float] = field(default_factory=list)  # perf_counter
    healthy_excused: int = 0  # loads in a starvation stall's shadow
    errors: list[BaseException] = field(default_factory=list)
    slow: list[tuple[str, float, float]] = field(default_factory=list)  # judged at the end

    def timed(self, kind: str, started: float) -> None:
        ended = time.perf_counter()
        self.raw_worst = max(self.raw_worst, ended - started)
        if ended - started > TIMEOUT:  # only slow calls are worth the starvation sum
            self.slow.append((kind, started, ended))

    def judge(self, starvation: Starvation) -> None:
        """The bound is the library's: a call's latency counts without the time the OS
        did not run this process (make test-stress keeps both cores busy)."""
        for kind, started, ended in self.slow:
            latency = ended - started - starvation.within(started, ended)
            if kind == "get":
                self.worst_get = max(self.worst_get, latency)
            else:
                self.worst_invalidate = max(self.worst_invalidate, latency)
        stalls = [(s, e) for s, e in starvation.stalls if e - s >= STALL]
        self.healthy_excused = sum(
            any(s <= at <= e + STALL_SHADOW for s, e in stalls) for at in self.healthy_loads_at
        )


def _cluster(full_coverage: bool) -> RedisClusterServers:
    extra = [] if full_coverage else ["--cluster-require-full-coverage", "no"]
    return RedisClusterServers(3, replicas=1, extra_args=extra)


def _cache(cluster: RedisClusterServers, prefix: str) -> LayeredCache:
    seeds = [f"{host}:{port}" for host, port in cluster.nodes[:3]]
    redis = {"cluster": True, "nodes": seeds, "timeout": f"{int(TIMEOUT * 1000)}ms"}
    namespaces = {"book": {"key": "book:{id}", "l1": False}}
    config = make_config(cluster.url, prefix, namespaces, redis=redis, backplane={"enabled": False})
    return LayeredCache.from_config(config)


def _master_of(cache: LayeredCache, key: str) -> str:
    slots = cache._store.client.nodes_manager.slots_cache  # type: ignore[union-attr]
    return str(slots[key_slot(key.encode())][0].name)


def _keys_on(cache: LayeredCache, master: str) -> list[int]:
    return [i for i in range(KEYS) if _master_of(cache, cache.key("book", {"id": i})) == master]


async def _warm(cache: LayeredCache, load: Callable[[int], Callable[[], Awaitable[str]]]) -> None:
    """Every key in L2 before the test breaks anything. A fill that timed out on a
    starved machine (a burst on a client that just learnt its slot map: seen in CI)
    left its key out, and the test later found it missing on the promoted replica:
    such keys are read again, one at a time, until Redis holds them (a check that
    times out is asked again)."""
    for start in range(0, KEYS, 50):
        ids = range(start, start + 50)
        await asyncio.gather(*(cache.get_or_load("book", {"id": i}, load(i)) for i in ids))
    client = cache._store.client
    for i in range(KEYS):
        for _ in range(20):
            try:
                held = await client.exists(cache.key("book", {"id": i}))
            except RedisError:
                held = None  # the check itself timed out (200 ms, seen in CI): ask again
            if held:
                break
            if held == 0:
                await cache.get_or_load("book", {"id": i}, load(i))
            await asyncio.sleep(0.05)


def _replicated(master: RedisServer) -> bool:
    """The master's replica has every write so far: killing it loses nothing."""
    client = master.client()
    try:
        info = client.info("replication")
    finally:
        client.close()
    replica = info.get("slave0")
    return isinstance(replica, dict) and replica.get("offset") == info["master_repl_offset"]


async def _promoted(cache: LayeredCache, dead: str) -> bool:
    """The client's slot map no longer names the dead master (a read refreshes it)."""
    await cache.get_or_load("book", {"id": 0}, _constant)
    masters = {_master_of(cache, cache.key("book", {"id": i})) for i in range(KEYS)}
    return dead not in masters and len(masters) == 3


async def _constant() -> str:
    return "v"


@pytest.mark.parametrize("full_coverage", [False, True], ids=["coverage-no", "coverage-yes"])
async def test_failover_keeps_every_call_within_the_timeout_and_healthy_keys_in_l2(
    prefix: str, full_coverage: bool
) -> None:
    seen = Observed()
    with _cluster(full_coverage) as cluster:
        dead = cluster.servers[0]  # redis-cli makes the first 3 nodes masters
        dead_name = f"{dead.host}:{dead.port}"
        async with _cache(cluster, prefix) as cache:
            on_dead: set[int] = set()
            counting = {"on": False}

            def load(i: int) -> Callable[[], Awaitable[str]]:
                async def loader() -> str:
                    if counting["on"]:
                        seen.loads["dead" if i in on_dead else "healthy"] += 1
                        if i not in on_dead:
                            seen.healthy_loads_at.append(time.perf_counter())
                    return "v"

                return loader

            await _warm(cache, load)
            assert await eventually(lambda: _replicated(dead), timeout=10)
            on_dead.update(_keys_on(cache, dead_name))
            stop = asyncio.Event()

            async def reader() -> None:
                while not stop.is_set():
                    i = random.randrange(KEYS)
                    started = time.perf_counter()
                    try:
                        assert await cache.get_or_load("book", {"id": i}, load(i)) == "v"
                    except BaseException as exc:  # every failure counts
                        seen.errors.append(exc)
                    seen.timed("get", started)
                    seen.reads += 1
                    await asyncio.sleep(0.005)

            async def invalidator() -> None:
                while not stop.is_set():
                    started = time.perf_counter()
                    # Keys nobody reads: their misses must not count as healthy loads.
                    # L2Unavailable while the key's master is down is the documented outcome.
                    with contextlib.suppress(L2Unavailable):
                        await cache.invalidate("book", {"id": KEYS + random.randrange(KEYS)})
                    seen.timed("invalidate", started)
                    await asyncio.sleep(0.05)

            with Starvation() as starvation:
                tasks = [asyncio.create_task(reader()) for _ in range(20)]
                tasks.append(asyncio.create_task(invalidator()))
                await asyncio.sleep(0.5)
                counting["on"] = True
                dead.kill()
                killed = time.monotonic()
                # Through the failover (node timeout 2 s, then the replica's election) and
                # 2 s past the client learning the new master.
                assert await eventually(
                    lambda: _promoted(cache, dead_name), timeout=60, interval=0.5
                )
                await asyncio.sleep(max(2.0, 6.0 - (time.monotonic() - killed)))
                stop.set()
                await asyncio.gather(*tasks)
            seen.judge(starvation)
    print(f"\n{seen.reads} reads; worst get {seen.worst_get:.3f} s, invalidate "
          f"{seen.worst_invalidate:.3f} s without starvation; raw worst {seen.raw_worst:.3f} s; "
          f"starved {starvation.total:.2f} s; healthy loads {seen.loads['healthy']} "
          f"({seen.healthy_excused} after a stall)")
    assert seen.errors == []
    assert seen.reads > 500
    assert seen.worst_get <= BOUND
    assert seen.worst_invalidate <= BOUND
    if not full_coverage:
        # Only with `cluster-require-full-coverage no` (docs/operations.md): with Redis's
        # default every node answers CLUSTERDOWN between the FAIL verdict and the
        # promotion, and those reads go to the database (the bound above still holds).
        # Loads right after the OS stalled this process are the stall's (see STALL).
        assert seen.loads["healthy"] - seen.healthy_excused <= 10


async def test_a_dead_masters_breaker_is_dropped_once_the_slot_map_loses_it(prefix: str) -> None:
    with _cluster(full_coverage=False) as cluster:
        dead = cluster.servers[0]
        dead_name = f"{dead.host}:{dead.port}"
        async with _cache(cluster, prefix) as cache:
            await _warm(cache, lambda i: _constant)
            doomed = _keys_on(cache, dead_name)
            assert await eventually(lambda: _replicated(dead), timeout=10)
            dead.kill()
            for i in doomed[:10]:  # enough failures to open the dead master's breaker
                assert await cache.get_or_load("book", {"id": i}, _constant) == "v"
            assert cache.redis_status().node_breakers[dead_name] in ("open", "half_open")

            async def recovered() -> bool:
                for i in doomed[:10]:
                    await cache.get_or_load("book", {"id": i}, _constant)
                breakers = cache.redis_status().node_breakers
                return dead_name not in breakers and set(breakers.values()) == {"closed"}

            assert await eventually(recovered, timeout=60, interval=0.3)
            # The promoted replica holds the dead master's keys and serves them from L2
            # (a read that times out on a starved machine falls back to the loader: the
            # next one is counted).
            client = cache._store.client
            assert all([await client.exists(cache.key("book", {"id": i})) for i in doomed])

            async def from_l2(i: int) -> bool:
                hits = cache.stats()["book"]["l2_hit"]
                await cache.get_or_load("book", {"id": i}, _constant)
                return bool(cache.stats()["book"]["l2_hit"] > hits)

            for i in doomed:
                assert await eventually(lambda i=i: from_l2(i), timeout=10)
            assert len(cache.redis_status().node_breakers) == 3
