"""Batches against a real Redis: a page of 50 books costs one round trip, its misses
load in one call, and every single-key guarantee (single-flight, the fleet-wide lease,
invalidation wins) still holds when the keys come in batches."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache._keys import lease_name, replica_names
from tests.faults.reply_delay import ReplyDelayProxy
from tests.helpers import in_l1, make_config
from tests.servers import RedisServer


class BatchLoader:
    """``load_many`` that counts its calls and the keys asked for, optionally gated."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.calls: list[list[int]] = []
        self.gate = gate
        self.started = asyncio.Event()

    async def __call__(self, fields_list: list[Mapping[str, object]]) -> list[Any]:
        ids = [int(str(fields["id"])) for fields in fields_list]
        self.calls.append(ids)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return [{"id": i, "title": f"book {i}"} for i in ids]

    def loads(self, key_id: int) -> int:
        return sum(call.count(key_id) for call in self.calls)


async def _commands(admin: redis.Redis, name: str) -> int:
    """Calls of ``name`` the server has run (scripts' calls included): the tests that
    count use a Redis of their own, since other tests run on the shared one meanwhile."""
    stats = await admin.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def _ids(n: int, start: int = 1) -> list[dict[str, int]]:
    return [{"id": i} for i in range(start, start + n)]


async def test_get_many_of_50_warm_keys_is_one_mget_in_order(
    redis_server: RedisServer, prefix: str
) -> None:
    config = make_config(redis_server.url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    admin = redis.Redis.from_url(redis_server.url)
    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [({"id": i}, f"v{i}") for i in range(1, 51)])
        mgets, gets = await _commands(admin, "mget"), await _commands(admin, "get")
        values = await cache.get_many("book", [*_ids(50), {"id": 999}])
        assert values == [f"v{i}" for i in range(1, 51)] + [None]
        assert await _commands(admin, "mget") - mgets == 1
        assert await _commands(admin, "get") - gets == 0
        assert cache.stats()["book"]["l2_hit"] == 50
    await admin.aclose()


async def test_get_many_reads_values_of_any_size_and_treats_other_types_as_misses(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    """The single-node MGET is packed and parsed by the library (``_direct``): values
    spanning several socket reads, a key holding a list (WRONGTYPE for a GET, nil in an
    MGET) and a missing key each land where they belong."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    async with LayeredCache.from_config(config) as cache:
        big = {i: "x" * (i * 40_000) for i in range(1, 6)}  # up to 200 KB each
        await cache.set_many("book", list(({"id": i}, v) for i, v in big.items()))
        await redis_client.rpush(cache.key("book", {"id": 6}), "not a value")
        values = await cache.get_many("book", _ids(7))
        assert values == [*big.values(), None, None]
        assert await cache.get_many("book", _ids(7)) == values  # the connection is sane


async def test_get_many_answers_l1_hits_without_redis(
    redis_server: RedisServer, prefix: str
) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    async with LayeredCache.from_config(make_config(redis_server.url, prefix)) as cache:
        await cache.set_many("book", [({"id": i}, i) for i in range(1, 11)])
        mgets = await _commands(admin, "mget")
        assert await cache.get_many("book", _ids(10)) == list(range(1, 11))
        assert await _commands(admin, "mget") == mgets
        assert cache.stats()["book"]["l1_hit"] == 10
    await admin.aclose()


async def test_a_set_many_into_a_full_l1_keeps_the_entries_reads_put_there(
    redis_server: RedisServer, prefix: str
) -> None:
    """Writes don't allocate in a full L1 (docs/operations.md, "The L1 bound"): a bulk
    write of 50 new keys into an L1 of 10 that reads filled evicted all 10 (each read
    then went to Redis again); now they stay, a key L1 holds takes its new value, and
    the new keys are read from L2, with their new values."""
    admin = redis.Redis.from_url(redis_server.url)
    namespaces = {"book": {"key": "book:{id}", "l1": {"max_entries": 10}}}
    async with LayeredCache.from_config(make_config(redis_server.url, prefix, namespaces)) as cache:
        loader = BatchLoader()
        await cache.get_or_load_many("book", _ids(10), loader)  # reads fill L1
        await cache.set_many("book", [({"id": 3}, "new 3"), *(({"id": i}, i) for i in range(100, 150))])
        gets, mgets = await _commands(admin, "get"), await _commands(admin, "mget")
        hot = await cache.get_many("book", _ids(10))
        assert (await _commands(admin, "get"), await _commands(admin, "mget")) == (gets, mgets)
        assert hot[2] == "new 3" and hot[0] == {"id": 1, "title": "book 1"}
        assert await cache.get_many("book", _ids(5, start=100)) == [100, 101, 102, 103, 104]
        assert await _commands(admin, "mget") == mgets + 1
    await admin.aclose()


async def test_get_or_load_many_loads_the_misses_in_one_call_in_order(
    redis_url: str, prefix: str
) -> None:
    loader = BatchLoader()
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        await cache.set("book", {"id": 3}, {"id": 3, "title": "cached"})
        fields = [{"id": 5}, {"id": 3}, {"id": 1}, {"id": 5}]  # a duplicate, a hit
        values = await cache.get_or_load_many("book", fields, loader)
        assert values == [
            {"id": 5, "title": "book 5"},
            {"id": 3, "title": "cached"},
            {"id": 1, "title": "book 1"},
            {"id": 5, "title": "book 5"},
        ]
        assert loader.calls == [[5, 1]]
        # Now everything is cached: no load at all.
        assert await cache.get_or_load_many("book", fields, loader) == values
        assert loader.calls == [[5, 1]]


async def test_get_or_load_many_reads_a_generator_of_fields_once(
    redis_url: str, prefix: str
) -> None:
    async def load_many(fields_list: list[dict[str, object]]) -> list[str]:
        return [f"v{fields['id']}" for fields in fields_list]

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        fields = ({"id": i} for i in range(3))
        assert await cache.get_or_load_many("book", fields, load_many) == ["v0", "v1", "v2"]


@pytest.mark.parametrize("returned", [[], [1, 2, 3], "ab"])
async def test_load_many_returning_the_wrong_shape_is_a_clear_error(
    redis_url: str, prefix: str, returned: Any
) -> None:
    async def wrong(fields_list: list[Mapping[str, object]]) -> Any:
        return returned

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        with pytest.raises((ValueError, TypeError), match="load_many"):
            await cache.get_or_load_many("book", _ids(2), wrong)
        # Nothing was cached and no lease is left behind.
        assert await cache.get_many("book", _ids(2)) == [None, None]
        admin = redis.Redis.from_url(redis_url)
        assert await admin.exists(lease_name(f"{prefix}book:1")) == 0
        await admin.aclose()


async def test_overlapping_concurrent_batches_and_single_calls_load_each_key_once(
    redis_url: str, prefix: str
) -> None:
    gate = asyncio.Event()
    loader = BatchLoader(gate)

    async def single(key_id: int) -> Any:
        async def load() -> Any:
            return (await loader([{"id": key_id}]))[0]

        return await cache.get_or_load("book", {"id": key_id}, load)

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        batches = [cache.get_or_load_many("book", _ids(10, start), loader) for start in (1, 6, 11)]
        singles = [single(i) for i in (1, 7, 12, 20)]
        running = asyncio.gather(*batches, *singles)
        await asyncio.sleep(0.2)  # every caller has claimed or joined its keys
        gate.set()
        results = await running
    assert results[0] == [{"id": i, "title": f"book {i}"} for i in range(1, 11)]
    assert all(loader.loads(i) == 1 for i in range(1, 21)), loader.calls


async def test_a_key_whose_lease_another_process_holds_is_waited_for_not_loaded_counted_once(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    loader = BatchLoader()
    async with (
        LayeredCache.from_config(config) as ours,
        LayeredCache.from_config(config) as theirs,
    ):
        gate = asyncio.Event()
        their_load = asyncio.ensure_future(
            theirs.get_or_load("book", {"id": 2}, _gated({"id": 2, "title": "theirs"}, gate))
        )
        await asyncio.sleep(0.1)  # they hold the lease of book:2
        batch = asyncio.ensure_future(ours.get_or_load_many("book", _ids(3), loader))
        await asyncio.sleep(0.2)
        gate.set()
        values = await batch
        await their_load
        stats = ours.stats()["book"]
    assert values[1] == {"id": 2, "title": "theirs"}  # their fill, not a second load
    assert loader.loads(2) == 0 and loader.loads(1) == 1 and loader.loads(3) == 1
    # Each key counted once: the batch's lost lease and the single-key wait that
    # follows it are one key's one miss.
    assert (stats["lease_lost"], stats["lease_won"], stats["miss"]) == (1, 2, 3)


def _gated(value: Any, gate: asyncio.Event) -> Any:
    async def load() -> Any:
        await gate.wait()
        return value

    return load


async def test_a_batch_fill_that_loaded_before_an_invalidation_never_lands(
    redis_url: str, prefix: str
) -> None:
    gate = asyncio.Event()
    loader = BatchLoader(gate)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        batch = asyncio.ensure_future(cache.get_or_load_many("book", _ids(3), loader))
        await asyncio.wait_for(loader.started.wait(), 5)
        await cache.invalidate("book", {"id": 2})  # the price of book 2 changed meanwhile
        gate.set()
        await batch
        assert await admin.exists(f"{prefix}book:2") == 0  # the old load was refused
        assert await admin.exists(f"{prefix}book:1") == 1
        assert cache.stats()["book"]["fill_revoked"] == 1
        assert await cache.get("book", {"id": 2}) is None  # nor is it in L1
    await admin.aclose()


async def test_set_many_is_one_round_trip_and_other_instances_drop_their_copies(
    redis_server: RedisServer, prefix: str
) -> None:
    config = make_config(redis_server.url, prefix)
    admin = redis.Redis.from_url(redis_server.url)
    async with (
        LayeredCache.from_config(config) as writer,
        LayeredCache.from_config(config) as reader,
    ):
        assert reader._backplane is not None
        await asyncio.wait_for(reader._backplane.connected.wait(), 5)
        await writer.set_many("book", [({"id": i}, "old") for i in range(1, 21)])
        assert await reader.get_many("book", _ids(20)) == ["old"] * 20  # now in its L1
        xadds = await _commands(admin, "xadd")
        await writer.set_many("book", [({"id": i}, "new") for i in range(1, 21)])
        assert await _commands(admin, "xadd") - xadds == 1  # one backplane entry

        async def reader_sees_new() -> bool:
            return await reader.get_many("book", _ids(20)) == ["new"] * 20

        for _ in range(100):
            if await reader_sees_new():
                break
            await asyncio.sleep(0.05)
        assert await reader_sees_new()
    await admin.aclose()


async def test_10000_concurrent_sets_complete_without_errors(redis_url: str, prefix: str) -> None:
    # Patient timeouts: the point is that admission bounds the burst (no connection
    # storm, no breaker trip), not how fast a starved CPU serves 10,000 writes.
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "l1": False}},
        redis={"timeout": "5s", "connect_timeout": "5s"},
    )
    async with LayeredCache.from_config(config) as cache:
        await asyncio.gather(*(cache.set("book", {"id": i}, i) for i in range(10_000)))
        assert cache.redis_status().breaker == "closed"
        assert cache.stats()["book"]["redis_error"] == 0
        values = await cache.get_many("book", _ids(10_000, 0))
        assert values == list(range(10_000))


async def test_get_many_in_a_batch_of_other_namespaces_keys_validates_every_field(
    redis_url: str, prefix: str
) -> None:
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        with pytest.raises(KeyError, match="id"):
            await cache.get_many("book", [{"id": 1}, {"isbn": 2}])


def _typed(values: Sequence[Any]) -> list[Any]:
    return list(values)


async def test_10000_concurrent_misses_of_distinct_keys_all_get_their_value(
    redis_url: str, prefix: str
) -> None:
    """Cold reads are admitted before their first Redis read, so the burst is served
    without errors on an idle machine. On a starved CPU (issue 22's busy loops) a few of
    the first reads can still time out: they fall back to the loader, every caller gets
    its value, and the breaker closes again."""
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "l1": False}},
        redis={"timeout": "5s", "connect_timeout": "5s"},
    )

    async def load() -> str:
        return "v"

    async with LayeredCache.from_config(config) as cache:
        results = await asyncio.gather(
            *(cache.get_or_load("book", {"id": i}, load) for i in range(10_000))
        )
        assert results == ["v"] * 10_000
        await asyncio.sleep(0.5)  # past the breaker's reset (300 ms in make_config)
        assert await cache.get_or_load("book", {"id": 0}, load) == "v"
        assert cache.redis_status().breaker == "closed"


async def test_get_many_reads_a_hot_key_from_a_replica(redis_url: str, prefix: str) -> None:
    namespaces = {
        "book": {"key": "book:{id}", "l1": False, "hot": {"replicas": 4, "keys": ["book:7"]}}
    }
    async with LayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:
        await cache.set_many("book", [({"id": 7}, "hot"), ({"id": 8}, "cold")])
        for _ in range(20):
            assert await cache.get_many("book", [{"id": 7}, {"id": 8}]) == ["hot", "cold"]
        stats = cache.stats()["book"]
        replica_reads = stats["replica_reads"]
        assert isinstance(replica_reads, dict) and sum(replica_reads.values()) == 20
        assert stats["replica_miss"] == 0


async def test_a_set_on_one_node_is_one_command_with_its_backplane_entry_after_its_write(
    redis_url: str, prefix: str
) -> None:
    """set() is one round trip and one command on a single node: a script that SETs the
    key, DELs its lease, then XADDs the backplane entry, atomically (still after the
    SET, so a reader that drops its copy on the entry can only refill the new value).
    Observed with MONITOR on the real server, which lists a script's commands too."""
    import threading

    import redis as sync_redis

    config = make_config(redis_url, prefix)
    seen: list[tuple[str, str]] = []  # (client, command) in the server's order
    ready, done = threading.Event(), threading.Event()

    def watch() -> None:
        with sync_redis.Redis.from_url(redis_url).monitor() as monitor:
            ready.set()
            for event in monitor.listen():
                client = str(event.get("client_type") or event.get("client_address"))
                if done.is_set():
                    seen.append((client, str(event["command"]).split(" ")[0].upper()))
                    if seen[-1] == ("lua", "XADD"):
                        return

    async with LayeredCache.from_config(config) as cache:
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        assert await asyncio.to_thread(ready.wait, 10)
        done.set()
        await cache.set("book", {"id": 1}, "new")
        await asyncio.to_thread(thread.join, 10)
    script = [command for client, command in seen if client == "lua"]
    assert script[-3:] == ["SET", "DEL", "XADD"], seen
    sent = [command for client, command in seen if client != "lua" and command != "XREAD"]
    assert sent[-1:] == ["EVALSHA"], seen  # one command: the script


async def test_keys_filled_by_a_batch_are_refreshed_early_like_single_reads(
    redis_url: str, prefix: str
) -> None:
    """A batch fill used to record no recompute time (XFetch's delta 0): a page read
    steadily never refreshed its books early, and every reader after the expiry missed.
    The batch's load time is now each entry's delta (draw fixed as in test_stampede's
    single-key scenario: a refresh starts within 0.46 s of the expiry)."""
    namespaces = {"book": {"key": "book:{id}", "l1": False, "l2": {"ttl": "2s", "jitter": 0},
                           "stampede": {"early_refresh_beta": 1.0}}}
    config = make_config(redis_url, prefix, namespaces, redis={"timeout": "2s"})
    calls = 0

    async def load_many(fields_list: Sequence[Mapping[str, Any]]) -> list[Any]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.2)
        return [f"v{fields['id']}" for fields in fields_list]

    async with LayeredCache.from_config(config, rand=lambda: 0.9) as cache:
        page = [{"id": 1}, {"id": 2}]
        start = asyncio.get_running_loop().time()
        assert await cache.get_or_load_many("book", page, load_many) == ["v1", "v2"]
        while asyncio.get_running_loop().time() < start + 2.6:
            assert await cache.get_or_load_many("book", page, load_many) == ["v1", "v2"]
            await asyncio.sleep(0.01)
        stats = cache.stats()["book"]
    assert stats["early_refresh"] == 2  # each book once, before its expiry
    assert stats["miss"] == 2  # the cold page only: nobody hit the expiry cliff
    assert calls == 3  # the cold batch, then one refresh per book


async def test_a_set_many_of_2500_keys_revokes_every_lease_and_replica_it_outdates(
    redis_url: str, prefix: str
) -> None:
    """The write script deletes what a write outdates 1,000 names to a call: 2,500 keys
    with 2 replicas each outdate 12,500 names (the lease, both replica leases, both
    replicas), across 13 calls. Every one is gone and every key holds its new value."""
    namespaces = {"book": {"key": "book:{id}", "l1": False, "hot": {"replicas": 2}}}
    config = make_config(redis_url, prefix, namespaces)
    admin = redis.Redis.from_url(redis_url)
    keys = [f"{prefix}book:{i}" for i in range(2_500)]
    outdated = [
        name
        for key in keys
        for name in (lease_name(key), *map(lease_name, replica_names(key, 2)), *replica_names(key, 2))
    ]  # what set() outdates for a key that is not hot here (_replicas.set_plan)
    for start in range(0, len(outdated), 1_000):
        await admin.mset({name: "in flight" for name in outdated[start : start + 1_000]})
    async with LayeredCache.from_config(config) as cache:
        await cache.set_many("book", [({"id": i}, f"v{i}") for i in range(2_500)])
        assert await admin.exists(*outdated) == 0
        assert await cache.get_many("book", _ids(2_500, start=0)) == [f"v{i}" for i in range(2_500)]
    await admin.aclose()



async def test_a_batch_that_raised_leaves_nothing_running_that_calls_load_many(
    redis_url: str, prefix: str
) -> None:
    """Key 2's lease is held by another process (waited for), key 1's load raises: the
    call raised at once, but its wait for key 2 ran on and called load_many([key 2])
    after max_wait, for nobody (the request and its database session long gone)."""
    ns = {"book": {"key": "book:{id}", "stampede": {"lease_ttl": "2s", "max_wait": "500ms"}}}
    calls: list[list[object]] = []

    async def load_many(missing: list[Mapping[str, object]]) -> list[str]:
        calls.append([f["id"] for f in missing])
        if 1 in calls[-1]:
            raise RuntimeError("database error for key 1")
        return [f"v{f['id']}" for f in missing]

    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, ns)) as cache:
        await admin.set(lease_name(cache.key("book", {"id": 2})), "another process", px=2000)
        with pytest.raises(RuntimeError, match="key 1"):
            await cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], load_many)
        await asyncio.sleep(1.0)  # past max_wait
        assert calls == [[1]]
        assert await admin.exists(lease_name(cache.key("book", {"id": 1}))) == 0
    await admin.aclose()


async def test_a_load_many_of_the_wrong_shape_raises_even_with_stale_values_at_hand(
    redis_url: str, prefix: str
) -> None:
    """A wrong count is a bug in load_many, not a failure to serve stale values for:
    served stale, it stayed invisible for up to stale.max_age."""
    ns = {"book": {"key": "book:{id}", "l1": False, "l2": {"ttl": "200ms", "jitter": 0},
                   "stale": {"max_age": "1m"}}}
    async with LayeredCache.from_config(make_config(redis_url, prefix, ns)) as cache:
        await cache.set_many("book", [({"id": 1}, "old1"), ({"id": 2}, "old2")])
        await asyncio.sleep(0.4)  # both stale now

        async def wrong(missing: list[Mapping[str, object]]) -> list[str]:
            return ["only one"]

        with pytest.raises(ValueError, match="load_many returned 1 values for 2 keys"):
            await cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], wrong)

        async def failing(missing: list[Mapping[str, object]]) -> list[str]:
            raise ConnectionError("database down")

        # A load that fails (not a bug in its shape) still gets the stale values.
        assert await cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], failing) == [
            "old1", "old2"]


async def test_a_load_many_that_empties_its_argument_gets_the_clear_error(
    redis_url: str, prefix: str
) -> None:
    async def popping(missing: list[Mapping[str, object]]) -> list[str]:
        while missing:
            missing.pop()
        return []

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        with pytest.raises(ValueError, match="load_many returned 0 values for 2 keys"):
            await cache.get_or_load_many("book", [{"id": 1}, {"id": 2}], popping)


class _RecordingPurger:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[str]]] = []

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((list(keys), list(tags)))


async def test_set_many_of_an_iterator_writes_and_purges_its_keys(
    redis_url: str, prefix: str
) -> None:
    """The iterator was read by the write, and the HTTP purge after it found it empty:
    the gateways kept the old pages."""
    purger = _RecordingPurger()
    config = make_config(redis_url, prefix, purge={"repeat_after": "0s"})
    async with LayeredCache.from_config(config, purger=purger) as cache:
        await cache.set_many("book", (({"id": i}, "new") for i in (1, 2)))
        assert await cache.get_many("book", [{"id": 1}, {"id": 2}]) == ["new", "new"]
        keys = [cache.key("book", {"id": 1}), cache.key("book", {"id": 2})]
        for _ in range(50):
            if purger.calls:
                break
            await asyncio.sleep(0.02)
        assert purger.calls == [(keys, [])]


FULL = {"book": {"key": "book:{id}", "l1": {"max_entries": 2, "ttl": "60s"}}}


async def _version(value: str) -> str:
    return value


async def test_a_set_of_a_key_a_full_l1_holds_keeps_it_when_a_read_fills_l1_meanwhile(
    late_replies: ReplyDelayProxy, prefix: str
) -> None:
    """Found by a review of this fix (2026-12-06). README, "Concurrent writers agree":
    "Writes don't allocate: into a full L1, set()/set_many replace the keys it holds".

    Scenario: L1 (max 2) is full with books 1 and 2, both put there by reads. set(book 1)
    is in flight (its reply takes 0.5 s); meanwhile a read of book 3 fills L1. Promised:
    the write replaces book 1, the key L1 held, and evicts nothing reads put there.
    Happens: ``Writes._begin`` drops book 1 from L1 before writing, the read takes that
    room, and ``L1Cache.replace_many`` then finds L1 full and book 1 "new": it stores
    nothing. The write evicted book 1, which a read put there, and the next read of the
    key just written goes to Redis (under read traffic, every write of a hot key into
    a full L1 evicts that key)."""
    config = make_config(late_replies.url, prefix, FULL, redis={"timeout": "3s"})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "v1")
        await cache.set("book", {"id": 2}, "b2")
        await cache.set("book", {"id": 3}, "b3")
        cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        for i in (1, 2):  # reads fill L1
            assert await cache.get_or_load("book", {"id": i}, lambda: _version("x")) != "x"
        assert in_l1(cache, 1) and in_l1(cache, 2)
        late_replies.match, late_replies.delay = cache.key("book", {"id": 1}).encode(), 0.5
        writing = asyncio.create_task(cache.set("book", {"id": 1}, "v2"))
        await asyncio.sleep(0.1)  # the write is in flight
        assert await cache.get_or_load("book", {"id": 3}, lambda: _version("x")) == "b3"
        await writing
        late_replies.match = None
        hits = cache.stats()["book"]["l1_hit"]
        assert await cache.get_or_load("book", {"id": 1}, lambda: _version("x")) == "v2"
        assert cache.stats()["book"]["l1_hit"] == hits + 1, (
            "the set() of book 1, which the full L1 held (a read put it there), left it "
            "out of L1: its next read went to Redis"
        )


async def test_a_set_many_into_a_full_l1_replaces_a_held_key_listed_after_a_new_one(
    redis_server: RedisServer, prefix: str
) -> None:
    """Found by a review of this fix (2026-12-06). README, "Concurrent writers agree":
    "Writes don't allocate: into a full L1, set()/set_many replace the keys it holds and
    store no new ones (reads do)"
    (``test_batch.py::test_a_set_many_into_a_full_l1_keeps_the_entries_reads_put_there``
    lists the held key first).

    Scenario: L1 (max 3) full with books 1, 2, 3 (reads put them there);
    ``set_many([(book 100, ...), (book 1, "new 1")])``, the new key first. Promised:
    book 1 (held) takes its new value in L1, book 100 (new) is not stored. Happens:
    ``Writes._begin`` drops book 1 first, so ``L1Cache.replace_many`` sees one free
    slot and gives it to book 100, the first "new" key in the list; book 1, now "new"
    too, finds L1 full and is left out: the write allocated a new key and evicted one
    reads put there."""
    namespaces = {"book": {"key": "book:{id}", "l1": {"max_entries": 3, "ttl": "60s"}}}
    async with LayeredCache.from_config(make_config(redis_server.url, prefix, namespaces)) as cache:
        await cache.set_many("book", [({"id": i}, f"b{i}") for i in (1, 2, 3)])
        cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        for i in (1, 2, 3):  # reads fill L1
            assert await cache.get_or_load("book", {"id": i}, lambda: _version("x")) == f"b{i}"
        await cache.set_many("book", [({"id": 100}, "b100"), ({"id": 1}, "new 1")])
        held = {i: in_l1(cache, i) for i in (1, 2, 3, 100)}
        assert held == {1: True, 2: True, 3: True, 100: False}, (
            f"after a set_many of a new key then a held one into a full L1, L1 holds {held}"
        )
