"""The cache against a real 3-master Redis Cluster (``redis.cluster = true``).

Slot reasoning the tests rely on: a replica name ``book:42#3`` has no hash tag, so
CRC16 spreads the replicas of one key over slots and therefore over masters; the lease
``{book:42}:lease`` and the fill channel carry the base key as hash tag, so the lease
check + write script touches one slot only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as redis
from redis.crc import key_slot

from layered_cache import Config, L2Unavailable, LayeredCache, _replicas
from layered_cache._keys import lease_name, replica_names
from layered_cache._placement import STICKY_READS
from tests.helpers import CountingLoader, eventually, make_config
from tests.test_hotkeys import run_invalidation_interleavings

Cluster = Any  # RedisClusterServers | ExistingRedisCluster (tests.servers)


def cluster_config(cluster: Cluster, prefix: str, l1: bool = True, **hot: Any) -> Config:
    namespaces: dict[str, dict[str, Any]] = {
        "book": {"key": "book:{id}", "l1": l1, "hot": {"replicas": 8, **hot}},
        "author": {"key": "author:{id}", "l1": False},
    }
    return make_config(cluster.url, prefix, namespaces, redis={"cluster": True, "timeout": "1s"})


@pytest.fixture
async def nodes(redis_cluster: Cluster) -> AsyncIterator[list[redis.Redis]]:
    """A plain client per master, to look at what each node really holds."""
    clients = [redis.Redis(host=host, port=port) for host, port in redis_cluster.nodes]
    yield clients
    for client in clients:
        await client.aclose()


async def slot_owners(node: redis.Redis) -> list[tuple[int, int, int]]:
    """(first slot, last slot, port of the master) from CLUSTER SLOTS."""
    raw = await node.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
    if isinstance(raw, dict):  # redis-py parses the reply into {(first, last): {...}}
        return [(lo, hi, int(info["primary"][1])) for (lo, hi), info in raw.items()]
    return [(int(r[0]), int(r[1]), int(r[2][1])) for r in raw]


def owner(slots: Sequence[tuple[int, int, int]], name: str) -> int:
    slot = key_slot(name.encode())
    return next(port for lo, hi, port in slots if lo <= slot <= hi)


async def test_replica_names_spread_over_slots_and_masters(
    redis_cluster: Cluster, prefix: str, nodes: list[redis.Redis]
) -> None:
    slots = await slot_owners(nodes[0])
    masters = {port for _, port in redis_cluster.nodes}

    # Placement is a property of the names (CRC16): every key's 8 replicas use >= 3
    # slots, and ~88% of keys (1 - 3*(2/3)^8 + 3*(1/3)^8) have a replica on each master.
    keys = [f"{prefix}book:{i}" for i in range(1000)]
    assert all(len({key_slot(n.encode()) for n in replica_names(k, 8)}) >= 3 for k in keys)
    covering = [k for k in keys if {owner(slots, n) for n in replica_names(k, 8)} == masters]
    assert len(covering) >= 800

    # Take such a key hot and check where the cache really wrote the replicas.
    key_id = int(covering[0].rsplit(":", 1)[1])
    key = covering[0]
    config = cluster_config(redis_cluster, prefix, keys=[f"book:{key_id}"])
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": key_id}, CountingLoader("v"))
    held = [{_text(n) for n in await node.keys(f"{key}#*")} for node in nodes]
    assert all(held), "every master holds at least one replica"
    assert set().union(*held) == set(replica_names(key, 8))
    assert len({key_slot(n.encode()) for n in set().union(*held)}) >= 3


async def test_detected_hot_key_spreads_its_reads_evenly_over_the_masters(
    redis_cluster: Cluster, prefix: str, nodes: list[redis.Redis]
) -> None:
    """The point of replicas: no single master serves the hot key's reads."""
    slots = await slot_owners(nodes[0])
    masters = {port for _, port in redis_cluster.nodes}
    key_id = next(
        i
        for i in range(1000)
        if {owner(slots, n) for n in replica_names(f"{prefix}book:{i}", 8)} == masters
    )
    config = cluster_config(  # L1 off: every read reaches L2
        redis_cluster, prefix, l1=False, threshold="50/s", window="200ms", cooldown="5s"
    )
    key = f"{prefix}book:{key_id}"
    loader = CountingLoader("v")
    async with LayeredCache.from_config(config) as cache:
        cache._store.placement.sticky_seconds = 0.0

        async def promoted_with_replicas() -> bool:
            await cache.get_or_load("book", {"id": key_id}, loader)
            return key in cache.hot_keys()["book"] and all(
                [await cache._store.get(name) for name in replica_names(key, 8)]
            )

        assert await eventually(promoted_with_replicas, timeout=3.0, interval=0.005)
        before = [await _gets(node) for node in nodes]
        # Sticky: one master for a turn, then the next one. With turns counted in reads
        # only (sticky_seconds = 0, set before the first turn), three rotations over
        # the three masters give each the same share, whatever the start.
        reads = 3 * 3 * STICKY_READS
        for _ in range(reads):
            await cache.get_or_load("book", {"id": key_id}, loader)
        served = [await _gets(node) - b for node, b in zip(nodes, before, strict=True)]
    shares = [n / sum(served) for n in served]
    assert sum(served) >= reads and max(shares) <= 0.45 and min(shares) >= 0.2, served
    assert loader.calls == 1


async def test_a_client_reads_one_master_at_a_time_and_a_fleet_reads_them_all(
    redis_cluster: Cluster, prefix: str, nodes: list[redis.Redis]
) -> None:
    """Reading a different master on every read costs one client throughput, so a client
    keeps one replica for a turn (STICKY_READS reads, and STICKY_SECONDS); clients start their rotations at random
    masters, so a fleet's reads of the key still land on every master."""
    slots = await slot_owners(nodes[0])
    masters = {port for _, port in redis_cluster.nodes}
    key_id = next(
        i
        for i in range(1000)
        if {owner(slots, n) for n in replica_names(f"{prefix}book:{i}", 8)} == masters
    )
    key = f"{prefix}book:{key_id}"
    config = cluster_config(redis_cluster, prefix, l1=False, keys=[f"book:{key_id}"])
    caches = [LayeredCache.from_config(config) for _ in range(12)]
    for cache in caches:
        await cache.start()
    placement = caches[0]._store.placement
    placement.sticky_seconds = 0.0  # turns of STICKY_READS reads, however fast
    try:
        await caches[0].get_or_load("book", {"id": key_id}, CountingLoader("v"))
        picks = [placement.pick(key, 8) for _ in range(3 * STICKY_READS)]
        rotation = [owner(slots, name) for _, name in picks[::STICKY_READS]]
        assert sorted(rotation) == sorted(masters), "one rotation visits every master"
        for turn in range(3):
            window = picks[turn * STICKY_READS : (turn + 1) * STICKY_READS]
            assert len(set(window)) == 1, "one replica for STICKY_READS reads"
        # A turn also lasts sticky_seconds: a fast client doesn't move on every few ms.
        placement.sticky_seconds = 3600.0
        placement.move_on(key)  # end the current turn; the next one lasts an hour
        assert len({placement.pick(key, 8) for _ in range(3 * STICKY_READS)}) == 1
        # A fleet: each instance's first read of the key goes where its rotation starts.
        before = [await _gets(node) for node in nodes]
        for cache in caches:
            assert await cache.get("book", {"id": key_id}) == "v"
        served = [await _gets(node) - b for node, b in zip(nodes, before, strict=True)]
    finally:
        for cache in caches:
            await cache.close()
    assert sum(served) == len(caches)
    # 12 instances, each starting at a master drawn uniformly: all of them on the same
    # master has probability 3 * (1/3)^12 ~ 6e-6.
    assert sum(1 for n in served if n) >= 2, served


async def test_a_missing_replica_is_read_from_the_base_key_and_the_client_moves_on(
    redis_cluster: Cluster, prefix: str, nodes: list[redis.Redis]
) -> None:
    slots = await slot_owners(nodes[0])
    config = cluster_config(redis_cluster, prefix, l1=False, keys=["book:3"])
    key = f"{prefix}book:3"
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": 3}, CountingLoader("v"))
        placement = cache._store.placement
        _, sticky = placement.pick(key, 8)
        await cache._store.delete([sticky])
        misses = cache.stats()["book"]["replica_miss"]
        assert await cache.get("book", {"id": 3}) == "v"  # from the base key
        assert cache.stats()["book"]["replica_miss"] == misses + 1
        _, after = placement.pick(key, 8)
        masters = {owner(slots, name) for name in replica_names(key, 8)}
        if len(masters) > 1:
            assert owner(slots, after) != owner(slots, sticky), "moved to the next master"


async def _gets(node: redis.Redis) -> int:
    stats = await node.info("commandstats")
    return int(stats.get("cmdstat_get", {}).get("calls", 0))


async def test_cache_operations_work_in_cluster_mode(redis_cluster: Cluster, prefix: str) -> None:
    config = cluster_config(redis_cluster, prefix, threshold="1000/s")
    loader = CountingLoader({"title": "Dune"})
    release = asyncio.Event()

    async def held_loader() -> object:  # A's load lasts until B is seen waiting on it
        await release.wait()
        return await loader()

    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        # Lease + Lua fill + fill notification: B waits on A's lease and is woken.
        in_a = asyncio.create_task(a.get_or_load("book", {"id": 1}, held_loader))
        assert await eventually(lambda: a.stats()["book"]["lease_won"] == 1, timeout=10)
        in_b = asyncio.create_task(b.get_or_load("book", {"id": 1}, held_loader))
        assert await eventually(lambda: b.stats()["book"]["lease_lost"] == 1, timeout=10)
        release.set()
        results = await asyncio.gather(in_a, in_b)
        assert list(results) == [{"title": "Dune"}] * 2 and loader.calls == 1
        assert b.stats()["book"]["lease_wait_filled"] + a.stats()["book"]["lease_wait_filled"] == 1

        assert await b.get("book", {"id": 1}) == {"title": "Dune"}
        await a.set("author", {"id": 9}, {"name": "Herbert"})
        assert await b.get("author", {"id": 9}) == {"name": "Herbert"}

        # Invalidate in A: L2 gone, and B's L1 copy dropped through the backplane stream.
        assert b._backplane is not None
        assert await eventually(b._backplane.connected.is_set)
        await a.invalidate("book", {"id": 1})

        async def dropped_in_b() -> bool:
            return await b.get("book", {"id": 1}) is None

        assert await eventually(dropped_in_b, timeout=2.0)
        assert b._backplane.entries_seen >= 1  # dropped by the stream, not by a TTL
        assert await a.get("book", {"id": 1}) is None
        assert a.redis_status().breaker == "closed" and b.redis_status().breaker == "closed"


async def test_invalidation_deletes_every_replica_on_every_node(
    redis_cluster: Cluster, prefix: str, nodes: list[redis.Redis]
) -> None:
    config = cluster_config(redis_cluster, prefix, keys=["book:7"])
    key = f"{prefix}book:7"
    names = [key, *replica_names(key, 8)]
    async with LayeredCache.from_config(config) as cache:
        await cache.get_or_load("book", {"id": 7}, CountingLoader("v"))
        assert await _existing(nodes, names) == set(names)
        # A leftover lease too (as if a fill were in flight): it must go as well.
        await cache._store.acquire_lease(lease_name(key), "someone", 10_000)
        await cache.invalidate("book", {"id": 7})
    assert await _existing(nodes, [*names, lease_name(key)]) == set()
    leftovers = [n for node in nodes for n in await node.keys(f"*{key}*")]
    assert leftovers == []


async def test_invalidation_during_hot_fill_leaves_no_stale_replica_in_cluster(
    redis_cluster: Cluster, prefix: str
) -> None:
    config = cluster_config(redis_cluster, prefix, keys=[f"book:{i}" for i in range(100)])
    node_urls = [f"redis://{host}:{port}/0" for host, port in redis_cluster.nodes]
    revoked = await run_invalidation_interleavings(config, node_urls, prefix, 100)
    assert revoked > 0


async def _existing(nodes: Sequence[redis.Redis], names: Sequence[str]) -> set[str]:
    """Names present on any node, asked of every node (no cluster routing involved)."""
    found: set[str] = set()
    for node in nodes:
        for name in names:
            try:
                if await node.exists(name):
                    found.add(name)
            except redis.ResponseError:  # MOVED: the name lives on another node
                continue
    return found


def _text(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


async def test_batches_and_tags_work_on_a_cluster(
    redis_cluster: Cluster, prefix: str, nodes: list[redis.Redis]
) -> None:
    """get_many is MGETs grouped by slot (one pipelined round trip per master, no GET),
    get_or_load_many and set_many cross slots, and invalidate_tag kills tagged entries
    whatever node they live on."""
    namespaces: dict[str, dict[str, Any]] = {
        "book": {"key": "book:{id}", "l1": False},
        "category": {"key": "category:{slug}", "l1": False, "tags": True},
    }
    config = make_config(
        redis_cluster.url, prefix, namespaces, redis={"cluster": True, "timeout": "1s"}
    )

    async def load_many(fields_list: Sequence[Any]) -> list[Any]:
        return [f"loaded {f['id']}" for f in fields_list]

    async def calls(command: str) -> int:
        total = 0
        for node in nodes:
            stats = await node.info("commandstats")
            total += int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))
        return total

    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [({"id": i}, f"v{i}") for i in range(50)])
        gets, mgets = await calls("get"), await calls("mget")
        values = await cache.get_many("book", [{"id": i} for i in range(60)])
        assert values == [f"v{i}" for i in range(50)] + [None] * 10
        assert await calls("get") == gets and await calls("mget") > mgets
        loaded = await cache.get_or_load_many("book", [{"id": i} for i in range(45, 55)], load_many)
        assert loaded == [f"v{i}" for i in range(45, 50)] + [f"loaded {i}" for i in range(50, 55)]
        for slug in ("a", "b", "c", "d"):
            await cache.set("category", {"slug": slug}, f"page {slug}", tags=["book:42"])
        await cache.invalidate_tag("book:42")
        slugs = [{"slug": slug} for slug in "abcd"]
        assert await cache.get_many("category", slugs) == [None] * 4


async def test_a_hot_key_whose_replicas_master_dies_is_read_from_its_base_not_loaded(
    prefix: str,
) -> None:
    """Found by a review (2026-12-05). Promise (README, "Redis trouble degrades"): "In a cluster each master
    has its own breaker, so one dead master doesn't send the healthy masters' keys to
    the database"; docs/hotkeys.md: "A missing or failing replica also ends the client's
    turn on that master".

    Scenario: book:K is hot (static), its base key lives on a healthy master, and some
    of its 8 replicas live on a master that dies. Reads rotate over the masters; each
    time the rotation reaches the dead one, the replica GET fails (L2Unavailable, or
    the open breaker) and ``_read_replica`` re-raises it, so ``Namespace._fetch`` calls
    the loader (``load_unleased``) although the base key and the other replicas are on
    healthy masters. Observed: the hot key - the one whose loads hurt most - is loaded
    from the database again and again while one master is down. Expected: a failed
    replica read falls back to the base key (as a missing replica does) or to a replica
    on another master: no load at all.
    Cause: ``_namespace._read_replica`` (``except L2Unavailable: move_on; raise``)."""
    from tests.servers import RedisClusterServers

    with RedisClusterServers(3, extra_args=["--cluster-require-full-coverage", "no"]) as cluster:
        seeds = [f"{host}:{port}" for host, port in cluster.nodes]
        probe = make_config(
            cluster.url, prefix,
            {"book": {"key": "book:{id}", "l1": False, "hot": {"replicas": 8}}},
            redis={"cluster": True, "nodes": seeds}, backplane={"enabled": False},
        )
        async with LayeredCache.from_config(probe) as c:
            slots = c._store.client.nodes_manager.slots_cache

            def master(name: str) -> str:
                return str(slots[key_slot(name.encode())][0].name)

            def fits(i: int) -> bool:
                base = master(f"{prefix}book:{i}")
                owners = {master(n) for n in replica_names(f"{prefix}book:{i}", 8)}
                return len(owners) == 3 and base in owners

            key_id = next(i for i in range(2000) if fits(i))
            base_master = master(f"{prefix}book:{key_id}")
        dead = next(s for s in cluster.servers if f"{s.host}:{s.port}" != base_master)
        config = make_config(
            cluster.url,
            prefix,
            {"book": {"key": "book:{id}", "l1": False,
                      "hot": {"replicas": 8, "keys": [f"book:{key_id}"]}}},
            redis={"cluster": True, "nodes": seeds, "timeout": "300ms",
                   "connect_timeout": "300ms"},
            backplane={"enabled": False},
        )
        loader = CountingLoader("v")
        async with LayeredCache.from_config(config) as cache:
            cache._store.placement.sticky_seconds = 0.0  # turns of 64 reads
            await cache.set("book", {"id": key_id}, "v")  # base + 8 replicas
            dead.kill()
            for _ in range(6 * 64):
                assert await cache.get_or_load("book", {"id": key_id}, loader) == "v"
        assert loader.calls == 0, (
            f"hot key with a healthy base loaded {loader.calls} times from the database"
        )


async def test_a_replica_copy_racing_a_cluster_set_never_leaves_replicas_older_than_the_base(
    redis_cluster: Any, prefix: str
) -> None:
    """Found by a review (2026-12-05). Promise (README, "Invalidation wins everywhere"): "After invalidate() returns,
    set() returns ..., no copy written before it (L1 of any instance, L2, a replica ...)
    is served"; docs/hotkeys.md: the background copy to replicas "uses the same
    protocol ... so an invalidation racing the copy leaves no replica".

    Scenario (3-master cluster, one set() and one background copy, no concurrent
    writers): B, where book:1 is cold, set()s "new". In a cluster B first DELs the base
    lease alone, then pipelines per node [DEL replica leases + replicas] and [SET base]:
    the nodes run their parts in any order. Here the base key's node answers late (a
    slow link). Meanwhile A, where book:1 is hot, reads a replica B already deleted,
    falls back to the base (still "old") and copies it: it wins the base lease (B
    deleted it *before* writing), reserves the replica leases (B already deleted
    them), reads "old" under the lease and writes it to the replicas. B's SET of the
    base lands last and B's set() returns.
    Observed: base = "new", replicas on the other masters = "old" until their TTL; A
    serves "old" after set() returned. Expected: no replica older than the base after
    set() returns (the copy must lose, as a fill does).
    Cause: the copy takes a *new* base lease, and set() in a cluster revoked the base
    lease before, not in the same step as, the base SET. Now the base write (whatever
    command carries it) and its lease go first, in one step, the replicas after
    (``_replicas.write_many``): the base key's node answering late holds them back too."""
    from redis.asyncio.cluster import ClusterNode

    key = f"{prefix}book:1"
    base_slot_names = {key.encode(), key}
    namespaces_hot = {
        "book": {"key": "book:{id}", "l1": False, "hot": {"replicas": 8, "keys": ["book:1"]}}
    }
    namespaces_cold = {
        "book": {"key": "book:{id}", "l1": False, "hot": {"replicas": 8, "threshold": "100000/s"}}
    }
    common = {"redis": {"cluster": True, "timeout": "2s"}, "backplane": {"enabled": False}}
    hot_cfg = make_config(redis_cluster.url, prefix, namespaces_hot, **common)
    cold_cfg = make_config(redis_cluster.url, prefix, namespaces_cold, **common)

    release = asyncio.Event()
    held = asyncio.Event()
    original = ClusterNode.execute_pipeline

    async def slow_base_node(self: ClusterNode, commands: list[Any]) -> bool:
        sets_base = any(  # the command that writes the base key: a SET, or a script
            str(c.args[0]).upper() in ("SET", "EVAL")
            and any(arg in base_slot_names for arg in c.args[1:4])
            for c in commands
        )
        if sets_base and not release.is_set():
            held.set()
            await release.wait()  # the base key's master answers late
        return await original(self, commands)

    async with (
        LayeredCache.from_config(hot_cfg) as a,
        LayeredCache.from_config(cold_cfg) as b,
    ):
        await a.set("book", {"id": 1}, "old")  # hot on A: base + 8 replicas
        ClusterNode.execute_pipeline = slow_base_node  # type: ignore[method-assign]
        try:
            writer = asyncio.ensure_future(b.set("book", {"id": 1}, "new"))
            await asyncio.wait_for(held.wait(), 5)
            await asyncio.sleep(0.05)  # the other masters ran their part: replicas gone
            # A reads: a deleted replica -> the base ("old") -> background copy.
            for _ in range(16):
                await a.get("book", {"id": 1})
                a._store.placement.move_on(key)
            await asyncio.sleep(0.3)  # the copy ran
            release.set()
            await asyncio.wait_for(writer, 5)  # set() returned
        finally:
            ClusterNode.execute_pipeline = original  # type: ignore[method-assign]
            release.set()
        nodes = [redis.Redis(host=h, port=p) for h, p in redis_cluster.nodes]
        codec = a.namespace("book").policy.codec
        stored: dict[str, Any] = {}
        try:
            for node in nodes:
                for name in [key, *replica_names(key, 8)]:
                    try:
                        data = await node.get(name)
                    except redis.ResponseError:  # MOVED: not this node's
                        continue
                    if data is not None:
                        stored[name] = codec.decode(data).value
        finally:
            for node in nodes:
                await node.aclose()
        assert stored.get(key) == "new"
        served = [await a.get("book", {"id": 1}) for _ in range(64)]
        stale = {n: v for n, v in stored.items() if v != "new"}
        assert not stale and "old" not in served, (stale, served)


async def test_a_cluster_set_of_a_hot_key_racing_an_invalidate_leaves_no_replica_without_its_base(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review (2026-12-06). Promise (DESIGN §6, README "Invalidation wins
    everywhere"): after invalidate() or set() returns, no older copy ("a replica"
    included) is served beyond the bound; "invalidation always deletes the base key,
    every replica and the lease"; docs/hotkeys.md recommends invalidate() against
    concurrent writers of a hot key.

    Scenario (3-master cluster): instance ``hot`` has book:1 as a static hot key,
    ``cold`` the same replica count without it being hot. ``hot.set("new")`` writes
    its base key (phase 1 of ``_replicas.write_many``); ``cold.invalidate()`` then runs
    to completion; only then does the set's phase 2 (the replicas) run. Both return.
    Observed: base gone, every replica "new": cold loads the database's value, hot
    serves "new" from the replicas for the L2 TTL. No order of the two calls leaves
    that state. Cause: phase 2 DELed each replica lease and SET each replica
    unconditionally, so the invalidation between the phases could not make it fail,
    as it makes a fill's guarded replica writes fail."""
    key = f"{prefix}book:1"
    static = {"replicas": 8, "keys": ["book:1"]}
    common = {"redis": {"cluster": True, "timeout": "2s"}, "backplane": {"enabled": False}}
    hot_cfg = make_config(
        redis_cluster.url, prefix, {"book": {"key": "book:{id}", "l1": False, "hot": static}},
        **common,
    )
    cold_ns = {"book": {"key": "book:{id}", "l1": False,
                        "hot": {"replicas": 8, "threshold": "100000/s"}}}
    cold_cfg = make_config(redis_cluster.url, prefix, cold_ns, **common)
    based, release = asyncio.Event(), asyncio.Event()
    original = _replicas._write_bases

    async def write_bases_then_wait(store: Any, writes: Any) -> None:
        await original(store, writes)
        based.set()
        await release.wait()  # phase 2 waits until the invalidation has returned

    async with (
        LayeredCache.from_config(hot_cfg) as hot,
        LayeredCache.from_config(cold_cfg) as cold,
    ):
        await hot.set("book", {"id": 1}, "old")  # base + 8 replicas
        monkeypatch.setattr(_replicas, "_write_bases", write_bases_then_wait)
        writer = asyncio.ensure_future(hot.set("book", {"id": 1}, "new"))
        await asyncio.wait_for(based.wait(), 5)
        await cold.invalidate("book", {"id": 1})
        release.set()
        await asyncio.wait_for(writer, 5)
        monkeypatch.setattr(_replicas, "_write_bases", original)
        stored = await _stored_values(redis_cluster, hot, [key, *replica_names(key, 8)])
        # The set's base write, then the invalidation: nothing of either may be left.
        assert stored == {}, stored
        assert await cold.get_or_load("book", {"id": 1}, CountingLoader("db")) == "db"
        served = {await hot.get("book", {"id": 1}) for _ in range(64)}
        assert served == {"db"}, served


async def _stored_values(cluster: Any, cache: LayeredCache, names: list[str]) -> dict[str, Any]:
    """The decoded value each of ``names`` holds, read from its own master."""
    nodes = [redis.Redis(host=h, port=p) for h, p in cluster.nodes]
    codec = cache.namespace("book").policy.codec
    stored: dict[str, Any] = {}
    try:
        for node in nodes:
            for name in names:
                try:
                    data = await node.get(name)
                except redis.ResponseError:  # MOVED: not this node's
                    continue
                if data is not None:
                    stored[name] = codec.decode(data).value
    finally:
        for node in nodes:
            await node.aclose()
    return stored


async def test_a_hot_fill_reserving_during_a_cluster_set_leaves_no_replica_older_than_the_base(
    redis_cluster: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set()'s reservations of the test above must hold: a fill that loaded the old
    value, reserved the replicas after the set() had (taking them over) and passed its
    base check before the set()'s base write, wrote its replicas after the set()'s
    guarded replica writes had failed on its reservations: base "new", replicas "old"
    for the L2 TTL. A fill's or a copy's reservation now leaves a set()'s alone
    (``RESERVE_SCRIPT``): the fill's replica writes fail, the set()'s land."""
    key = f"{prefix}book:1"
    static = {"replicas": 8, "keys": ["book:1"]}
    config = make_config(
        redis_cluster.url, prefix, {"book": {"key": "book:{id}", "l1": False, "hot": static}},
        redis={"cluster": True, "timeout": "2s"}, backplane={"enabled": False},
    )
    reserved, release, loaded = asyncio.Event(), asyncio.Event(), asyncio.Event()
    checked, set_done = asyncio.Event(), asyncio.Event()
    original = _replicas._write_bases

    async def reserved_then_wait(store: Any, writes: Any) -> None:
        reserved.set()
        await release.wait()  # the fill runs between the set's reservation and base write
        await original(store, writes)

    async def old_load() -> str:
        await loaded.wait()  # read from the database before the set() wrote it
        return "old"

    async with (
        LayeredCache.from_config(config) as filler,
        LayeredCache.from_config(config) as writer,
    ):
        fill_replicas = filler._store.fill_replicas

        async def late_replicas(*args: Any) -> int:
            checked.set()  # the fill passed its base check (and wrote the base)
            await set_done.wait()  # its replica writes come after the set() returned
            return await fill_replicas(*args)

        filler._store.fill_replicas = late_replicas  # type: ignore[method-assign]
        filling = asyncio.ensure_future(filler.get_or_load("book", {"id": 1}, old_load))
        assert await eventually(lambda: filler.stats()["book"]["lease_won"] == 1)
        monkeypatch.setattr(_replicas, "_write_bases", reserved_then_wait)
        setting = asyncio.ensure_future(writer.set("book", {"id": 1}, "new"))
        await asyncio.wait_for(reserved.wait(), 5)
        loaded.set()
        await asyncio.wait_for(checked.wait(), 5)
        release.set()
        await asyncio.wait_for(setting, 5)
        set_done.set()
        assert await asyncio.wait_for(filling, 5) == "old"  # its caller read before the set
        stored = await _stored_values(redis_cluster, writer, [key, *replica_names(key, 8)])
    assert stored.pop(key) == "new"
    assert set(stored.values()) <= {"new"}, stored


async def test_a_cluster_hot_set_whose_replica_phase_times_out_leaves_no_replica_older_than_its_base(
    redis_cluster: Cluster, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/hotkeys.md (set()): the cluster set() runs reserve / base / replicas so that
    it never leaves "replicas older than the base"; README ("Invalidation wins
    everywhere"): "a cluster set()/set_many whose write fails after some masters'
    writes landed ... announces its keys in the background before it raises" - so no
    instance keeps serving the replaced value. ``Writes._written`` itself says why
    announcing is not enough once the bases landed: "announcing alone left old
    replicas" (it drops the keys everywhere, but only for a memory refusal).
    Scenario (3-master cluster, redis.timeout 300 ms): book:1 static hot, 8 replicas,
    l1 off. set("old"). Then set("new"): its base write lands (phase 1), and the masters
    other than the base's stall writes (CLIENT PAUSE WRITE, 1.5 s: a stalled master)
    before its guarded replica writes (phase 2), which time out: set() raises
    L2Unavailable. After the stall, read what Redis holds and read the key 48 times.
    Expected: no replica holds "old" while the base holds "new" (a missing replica is a
    read of the base); the set() failed, so its keys are dropped everywhere, the base
    too, as an invalidation of them.
    Happened: the replicas on the stalled masters kept "old" for the L2 TTL (their leases
    held by the set()'s reservation, so no copy replaced them) and reads of the hot key
    served "old" while the base held "new". Cause: ``_replicas.write_many`` /
    ``Writes._write``: a phase-2 failure other than a memory refusal only announced
    (``WriteEnds.abandoned``), it did not drop the replicas the failed guarded writes
    left with the replaced value. Now a failure once the phases began drops the keys
    everywhere, retried in the background (``WriteEnds.drop_later``)."""
    key = f"{prefix}book:1"
    static = {"replicas": 8, "keys": ["book:1"]}
    config = make_config(
        redis_cluster.url, prefix, {"book": {"key": "book:{id}", "l1": False, "hot": static}},
        redis={"cluster": True, "timeout": "300ms", "breaker": {"failures": 1000}},
        backplane={"enabled": False},
    )
    seed = redis.Redis(host=redis_cluster.nodes[0][0], port=redis_cluster.nodes[0][1])
    slots = await slot_owners(seed)
    await seed.aclose()
    base_port = owner(slots, key)
    others = [(h, p) for h, p in redis_cluster.nodes if p != base_port]
    replica_ports = {owner(slots, n) for n in replica_names(key, 8)}
    assert replica_ports - {base_port}, "some replica lives on another master than the base"
    original = _replicas._write_bases

    async def bases_then_stall(store: Any, writes: Any) -> None:
        await original(store, writes)
        for host, port in others:  # a stalled master (writes held 1.5 s)
            node = redis.Redis(host=host, port=port)
            await node.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
            await node.aclose()

    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "old")
        monkeypatch.setattr(_replicas, "_write_bases", bases_then_stall)
        with pytest.raises(L2Unavailable):
            await cache.set("book", {"id": 1}, "new")
        monkeypatch.setattr(_replicas, "_write_bases", original)
        await asyncio.sleep(2.0)  # the stall is over
        cache._store.placement.sticky_seconds = 0.0
        stored = await _stored_values(redis_cluster, cache, [key, *replica_names(key, 8)])
        served = [await cache.get("book", {"id": 1}) for _ in range(6 * STICKY_READS)]
    # The set() failed: its keys were dropped everywhere (an invalidation), the base too.
    assert stored.get(key) in ("new", None), stored
    old = {name: v for name, v in stored.items() if v == "old"}
    assert not old and "old" not in served, (old, sorted(set(map(str, served))))
