"""Concurrent ``set()`` calls of one key: this instance's L1 ends equal to L2 (issue 21,
item 7). Two writers of one key in one instance race; once both have returned, the
value L1 serves must be the value L2 holds (the last write to L2), or L1 must be empty
so the next read refills from L2. Otherwise the instance serves its own value while the
fleet serves L2's, for up to the L1 TTL.

Interleavings are forced from the test side, as the explorer does
(``tests/explorer/scheduler.py``): redis-py's async client classes are patched for the
test only, so each writer's pipeline waits a seeded random 0-3 ms before it is sent and
after its reply arrives (L2 order and settle order then differ from call order), and so
do the replies of GETs, backplane appends and fill scripts (a concurrent read that
read L2 mid-race fills L1 late). The library carries no hook. A raw client reads L2 (the base key) and decodes it with the codec.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.client as redis_client
import redis.asyncio.cluster as redis_cluster
from redis.asyncio.cluster import RedisCluster

from layered_cache import LayeredCache
from layered_cache import _direct as direct
from layered_cache._l1 import MISSING
from layered_cache.sync import SyncLayeredCache
from tests.helpers import CountingLoader, eventually, make_config

PLAIN = {"book": {"key": "book:{id}"}}
HOT = {"book": {"key": "book:{id}", "hot": {"replicas": 4, "keys": ["book:1"]}}}
KEY = {"id": 1}
DELAYS = (0.0, 0.0, 0.0005, 0.001, 0.003)
# Replies after which a caller decides about L1: a read, a set()'s backplane append (its
# L1 fill follows), a leased fill script.
_COMMANDS = frozenset({"GET", "XADD", "EVALSHA", "EVAL"})


def _delayed(original: Callable[..., Any], rng: random.Random, pipeline: bool) -> Any:
    @functools.wraps(original)
    async def delayed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not pipeline and (not args or str(args[0]).upper() not in _COMMANDS):
            return await original(self, *args, **kwargs)
        if pipeline:
            await asyncio.sleep(rng.choice(DELAYS))
        result = await original(self, *args, **kwargs)
        await asyncio.sleep(rng.choice(DELAYS))
        return result

    return delayed


@contextlib.contextmanager
def shuffled_replies(seed: int) -> Iterator[None]:
    """Delay every async pipeline before sending and after its reply, and the replies
    of ``_COMMANDS``, by seeded random amounts; restore the classes on exit."""
    rng = random.Random(seed)
    targets = [
        (redis_client.Pipeline, "execute", True),
        (redis_cluster.ClusterPipeline, "execute", True),
        (redis_client.Redis, "execute_command", False),
        (redis_cluster.RedisCluster, "execute_command", False),
        (direct, "execute_command", False),  # GET and set()'s write on a single node
        (direct.HeldConnection, "execute", False),  # the listener's stream commands
    ]
    saved = [(cls, attr, vars(cls)[attr]) for cls, attr, _ in targets]
    try:
        for cls, attr, pipeline in targets:
            setattr(cls, attr, _delayed(vars(cls)[attr], rng, pipeline))
        yield
    finally:
        for cls, attr, original in saved:
            setattr(cls, attr, original)


class Tally:
    """Rounds that ended with L1 holding L2's value, empty, or something else."""

    def __init__(self) -> None:
        self.equal = 0
        self.empty = 0
        self.wrong: list[str] = []

    def check(self, round_: int, l1: Any, l2: Any, empty_ok: bool = True) -> None:
        if not empty_ok:
            if l1 != l2:
                self.wrong.append(f"round {round_}: get() {l1!r}, L2 {l2!r}")
            return
        if l1 is MISSING:
            self.empty += 1
        elif l1 == l2:
            self.equal += 1
        else:
            self.wrong.append(f"round {round_}: L1 {l1!r}, L2 {l2!r}")

    def assert_agreed(self, rounds: int) -> None:
        assert not self.wrong, f"{len(self.wrong)} of {rounds} rounds: {self.wrong[:5]}"
        assert self.equal + self.empty == rounds


def _l1_value(cache: LayeredCache) -> Any:
    namespace = cache.namespace("book")
    assert namespace.policy.l1 is not None
    return namespace.policy.l1.get(namespace.key(KEY))


def _l1_agrees(caches: tuple[LayeredCache, ...], l2: Any) -> bool:
    return all(_l1_value(cache) in (MISSING, l2) for cache in caches)


async def _l2_value(cache: LayeredCache, admin: Any) -> Any:
    namespace = cache.namespace("book")
    data = await admin.get(namespace.key(KEY))
    return None if data is None else namespace.policy.codec.decode(data).value


Calls = Callable[[int], list[Awaitable[Any]]]


def _sets(cache: LayeredCache, reader: bool = False, invalidate: bool = False) -> Calls:
    """Round ``n``'s concurrent calls: set() of ``a<n>`` and ``b<n>``, maybe a
    read-through of the same key, maybe an invalidate() of it."""

    def calls(round_: int) -> list[Awaitable[Any]]:
        started = [cache.set("book", KEY, f"a{round_}"), cache.set("book", KEY, f"b{round_}")]
        if reader:
            started.append(cache.get_or_load("book", KEY, CountingLoader(f"db{round_}")))
        if invalidate:
            started.insert(round_ % 3, cache.invalidate("book", KEY))
        return started

    return calls


async def _race_async(
    cache: LayeredCache, admin: Any, rounds: int, calls: Calls, base_agrees: bool = True
) -> Tally:
    """``rounds`` of ``calls`` run concurrently, checking L1 against L2 after each.
    Every fourth round starts with the key absent from L2, so a read-through loads and
    fills under its lease as well."""
    tally = Tally()
    for round_ in range(rounds):
        if round_ % 4 == 0:
            await cache.invalidate("book", KEY)
        await asyncio.gather(*calls(round_))
        l2 = await _l2_value(cache, admin)
        tally.check(round_, _l1_value(cache), l2)
        if base_agrees:  # the next read (L1 or, after a refill, L2) serves L2's value
            tally.check(round_, await cache.get("book", KEY), l2, empty_ok=False)
    return tally


async def test_two_concurrent_sets_leave_l1_equal_to_l2(redis_url: str, prefix: str) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, PLAIN)) as cache:
        with shuffled_replies(seed=7):
            tally = await _race_async(cache, admin, 400, _sets(cache))
    tally.assert_agreed(400)
    await admin.aclose()


async def test_two_concurrent_sets_and_a_read_leave_l1_equal_to_l2(
    redis_url: str, prefix: str
) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, PLAIN)) as cache:
        with shuffled_replies(seed=13):
            tally = await _race_async(cache, admin, 400, _sets(cache, reader=True))
    tally.assert_agreed(400)
    await admin.aclose()


async def test_two_concurrent_sets_and_a_read_of_a_hot_key_leave_l1_equal_to_l2(
    redis_url: str, prefix: str
) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, HOT)) as cache:
        with shuffled_replies(seed=11):
            tally = await _race_async(cache, admin, 400, _sets(cache, reader=True))
    tally.assert_agreed(400)
    await admin.aclose()


async def test_sets_racing_an_invalidate_and_a_read_leave_l1_equal_to_l2(
    redis_url: str, prefix: str
) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, HOT)) as cache:
        with shuffled_replies(seed=29):
            calls = _sets(cache, reader=True, invalidate=True)
            tally = await _race_async(cache, admin, 400, calls)
    tally.assert_agreed(400)
    await admin.aclose()


async def test_two_concurrent_sets_in_a_cluster_leave_l1_equal_to_the_base_key(
    redis_cluster: Any, prefix: str
) -> None:
    """A cluster can't write the base key and its replicas in one transaction
    (docs/hotkeys.md): the replicas of a hot key may end with the other writer's value,
    and a read served from one of them is not checked against the base key here. L1
    itself, after the race, must hold the base key's value or nothing."""
    admin = RedisCluster.from_url(redis_cluster.url)
    redis_section = {"cluster": True, "timeout": "1s", "connect_timeout": "1s"}
    for seed, namespaces in ((17, PLAIN), (19, HOT)):
        # Own prefix per config: the fleet's recorded replica count differs.
        config = make_config(redis_cluster.url, f"{prefix}{seed}:", namespaces, redis=redis_section)
        async with LayeredCache.from_config(config) as cache:
            with shuffled_replies(seed):
                calls = _sets(cache, reader=True, invalidate=seed == 19)
                tally = await _race_async(cache, admin, 200, calls, namespaces is PLAIN)
        tally.assert_agreed(200)
    await admin.aclose()


async def test_two_instances_setting_one_key_end_with_l1_equal_to_l2(
    redis_url: str, prefix: str
) -> None:
    """Writers in two instances: each hears of the other's write through the backplane,
    so within its latency every L1 holds L2's value or nothing."""
    admin = aioredis.Redis.from_url(redis_url)
    config = make_config(redis_url, prefix, PLAIN)
    async with (
        LayeredCache.from_config(config) as one,
        LayeredCache.from_config(config) as two,
    ):
        with shuffled_replies(seed=31):
            for round_ in range(200):
                await asyncio.gather(
                    one.set("book", KEY, f"a{round_}"),
                    two.set("book", KEY, f"b{round_}"),
                    one.get_or_load("book", KEY, CountingLoader(f"db{round_}")),
                    two.get_or_load("book", KEY, CountingLoader(f"db{round_}")),
                )
                l2 = await _l2_value(one, admin)
                agreed = functools.partial(_l1_agrees, (one, two), l2)
                assert await eventually(agreed), (round_, _l1_value(one), _l1_value(two), l2)
    await admin.aclose()


def _race_threads(cache: SyncLayeredCache, admin: redis.Redis, rounds: int) -> Tally:
    """Two threads call set() of one key at once (a barrier starts each round)."""
    tally = Tally()
    barrier = threading.Barrier(2)

    def writer(name: str) -> None:
        for round_ in range(rounds):
            barrier.wait(timeout=20)
            cache.set("book", KEY, f"{name}{round_}")
            barrier.wait(timeout=20)
            if name == "a":  # one thread checks while the other waits
                namespace = cache.cache.namespace("book")
                data = admin.get(namespace.key(KEY))
                l2 = None if data is None else namespace.policy.codec.decode(data).value
                tally.check(round_, _l1_value(cache.cache), l2)
                tally.check(round_, cache.get("book", KEY), l2, empty_ok=False)

    threads = [threading.Thread(target=writer, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return tally


def test_two_threads_setting_one_key_leave_l1_equal_to_l2(redis_url: str, prefix: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    for name, namespaces in (("plain", PLAIN), ("hot", HOT)):
        config = make_config(redis_url, f"{prefix}{name}:", namespaces)
        with (
            SyncLayeredCache.from_config(config) as cache,
            shuffled_replies(seed=23),
        ):
            tally = _race_threads(cache, admin, 100)
        tally.assert_agreed(100)
    admin.close()
