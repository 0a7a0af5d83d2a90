"""A lease is given back on every way out of a load, cancellation included.

A lease nobody fills makes every other reader of the key, in every process, wait up to
``max_wait`` and then load the key itself: a stampede, under exactly the load that makes
clients time out. Each scenario here cancels or breaks the holder at a different point
and asks a second instance to read the key: it must get the value well before
``max_wait`` (3 s here). Found by an adversarial review (2026-12-04); every test failed
before the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import pytest
import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache._batch_read import BatchReader
from layered_cache._django_locked import locked
from layered_cache._keys import lease_name, lock_name
from layered_cache._l2 import L2Unavailable
from tests.faults.reply_delay import ReplyDelayProxy
from tests.helpers import CountingLoader, eventually, make_config

NAMESPACES = {
    "book": {"key": "book:{id}", "stampede": {"lease_ttl": "4s", "max_wait": "3s"}},
    "category": {
        "key": "category:{slug}",
        "tags": True,
        "stampede": {"lease_ttl": "4s", "max_wait": "3s"},
    },
}
PROMPT = 1.0  # seconds: well under max_wait


async def _slow(value: Any, seconds: float = 0.3) -> Any:
    await asyncio.sleep(seconds)
    return value


async def _timed(read: Any) -> tuple[Any, float]:
    started = time.monotonic()
    value = await read
    return value, time.monotonic() - started


async def test_a_winner_whose_caller_timed_out_still_fills_for_the_other_instances(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    loads = 0

    async def loader() -> str:
        nonlocal loads
        loads += 1
        return await _slow("db")

    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):  # a request deadline, mid-load
                await a.get_or_load("book", {"id": 1}, loader)
        value, took = await _timed(b.get_or_load("book", {"id": 1}, loader))
        assert value == "db" and took < PROMPT
        assert loads == 1  # b got a's load, which ran on after a's caller left


async def test_a_joiner_of_a_cancelled_leader_gets_the_value_promptly(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as a:
        leader = asyncio.create_task(a.get_or_load("book", {"id": 1}, lambda: _slow("db")))
        await asyncio.sleep(0.05)  # the leader holds the lease and loads
        joiner = asyncio.create_task(_timed(a.get_or_load("book", {"id": 1}, lambda: _slow("db"))))
        await asyncio.sleep(0.05)
        leader.cancel()  # the first client went away; the second did not
        value, took = await joiner
        assert value == "db" and took < PROMPT


async def test_a_loader_that_raises_cancelled_error_gives_the_lease_back(
    redis_url: str, prefix: str
) -> None:
    """An aborted database query re-raises CancelledError inside the loader while the
    caller itself was not cancelled: a load error for the caller
    (``LoaderCancelledError``), and the lease goes back."""

    async def aborted() -> str:
        inner = asyncio.create_task(asyncio.sleep(10))
        await asyncio.sleep(0.01)
        inner.cancel()
        return await inner  # type: ignore[func-returns-value]

    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        with pytest.raises(RuntimeError, match="raised CancelledError without being cancelled"):
            await a.get_or_load("book", {"id": 1}, aborted)
        value, took = await _timed(b.get_or_load("book", {"id": 1}, lambda: _slow("db", 0)))
        assert value == "db" and took < PROMPT


@pytest.mark.parametrize("turns", range(0, 24, 2))
async def test_a_read_cancelled_after_any_number_of_loop_turns_leaves_no_lease(
    redis_url: str, prefix: str, turns: int
) -> None:
    """The cancel lands in the SET NX's reply, in the double-check GET, in the load or
    in the fill, depending on ``turns``."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        task = asyncio.create_task(a.get_or_load("book", {"id": 1}, lambda: _slow("db", 0.05)))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        value, took = await _timed(b.get_or_load("book", {"id": 1}, lambda: _slow("db", 0)))
        assert value == "db" and took < PROMPT


async def test_a_batch_whose_caller_timed_out_gives_every_lease_back(
    redis_url: str, prefix: str
) -> None:
    fields = [{"id": i} for i in range(5)]

    async def load_many(missing: list[Mapping[str, object]], delay: float = 0.3) -> list[str]:
        await asyncio.sleep(delay)
        return [f"v{f['id']}" for f in missing]

    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):
                await a.get_or_load_many("book", fields, load_many)
        values, took = await _timed(
            b.get_or_load_many("book", fields, lambda m: load_many(m, 0.0))
        )
        assert values == [f"v{i}" for i in range(5)] and took < PROMPT


async def test_a_batch_whose_tag_function_raises_gives_every_lease_back(
    redis_url: str, prefix: str, redis_client: Any
) -> None:
    async def load_many(missing: list[Mapping[str, object]]) -> list[str]:
        return [f"page-{f['slug']}" for f in missing]

    def broken_tags(page: Any) -> list[str]:
        raise RuntimeError("a bug in the tag function")

    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        with pytest.raises(RuntimeError, match="tag function"):
            await a.get_or_load_many("category", [{"slug": "a"}], load_many, tags=broken_tags)
        assert await redis_client.exists(lease_name(a.key("category", {"slug": "a"}))) == 0
        value, took = await _timed(
            b.get_or_load("category", {"slug": "a"}, lambda: _slow("page", 0), tags=["t"])
        )
        assert value == "page" and took < PROMPT


class Abort(BaseException):
    """Not an ``Exception``: gevent's ``GreenletExit``, a framework's own abort."""


@pytest.mark.parametrize("namespace", ["book", "category"])
async def test_a_loader_raising_what_is_not_an_exception_gives_the_lease_back(
    redis_url: str, prefix: str, namespace: str
) -> None:
    """Nothing to serve stale for and nothing will fill: the abort reaches the caller
    and the lease goes back, so another instance loads at once (a tagged namespace also
    leaves its loading set)."""

    async def aborts() -> str:
        raise Abort("request aborted")

    config = make_config(redis_url, prefix, NAMESPACES)
    fields = {"id": 1} if namespace == "book" else {"slug": "scifi"}
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        with pytest.raises(Abort):
            await a.get_or_load(namespace, fields, aborts)
        value, took = await _timed(b.get_or_load(namespace, fields, lambda: _slow("db", 0)))
        assert value == "db" and took < PROMPT


async def test_a_batch_loader_raising_what_is_not_an_exception_gives_every_lease_back(
    redis_url: str, prefix: str
) -> None:
    async def aborts(missing: list[dict[str, Any]]) -> list[str]:
        raise Abort("request aborted")

    config = make_config(redis_url, prefix, NAMESPACES)
    fields = [{"id": i} for i in range(5)]
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        with pytest.raises(Abort):
            await a.get_or_load_many("book", fields, aborts)
        started = time.monotonic()
        values = await b.get_or_load_many("book", fields, lambda missing: _slow(["db"] * len(missing), 0))
        assert values == ["db"] * 5 and time.monotonic() - started < PROMPT


SLOW_A = {"timeout": "200ms", "connect_timeout": "200ms", "breaker": {"failures": 100}}
LONG_LEASE = {"book": {"key": "book:{id}", "stampede": {"lease_ttl": "5s", "max_wait": "1500ms"}}}


@pytest.mark.parametrize("late", ["the SET NX", "the check after a won SET NX"])
async def test_a_lease_a_timed_out_read_may_hold_is_given_back(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy, late: str
) -> None:
    """Instance A's SET NX lands but its reply comes after redis.timeout (or it wins and
    the GET right after times out): A loads without writing L2, and the lease it holds
    stayed for lease_ttl. Instance B, on a healthy Redis, then waited max_wait for a
    fill nobody runs and loaded without filling L2, as did every reader until then."""
    a_config = make_config(late_replies.url, prefix, LONG_LEASE, redis=SLOW_A)
    admin = redis.Redis.from_url(redis_url)
    async with (
        LayeredCache.from_config(a_config) as a,
        LayeredCache.from_config(make_config(redis_url, prefix, LONG_LEASE)) as b,
    ):
        if late == "the SET NX":
            late_replies.match, late_replies.delay = b"NX", 0.5
        else:
            acquire = a._store.acquire_lease

            async def won_then_late(*args: Any) -> bool:
                won: bool = await acquire(*args)
                late_replies.match, late_replies.delay = b"GET", 0.5
                return won

            a._store.acquire_lease = won_then_late  # type: ignore[method-assign]
        assert await a.get_or_load("book", {"id": 1}, CountingLoader("from A")) == "from A"
        late_replies.match = None
        lease = lease_name(a.key("book", {"id": 1}))
        assert await eventually(lambda: _gone(admin, lease), timeout=1.0)
        value, took = await _timed(b.get_or_load("book", {"id": 1}, CountingLoader("from B")))
        assert value == "from B" and took < 0.5
        assert await admin.exists(a.key("book", {"id": 1})) == 1  # B filled L2
    await admin.aclose()


async def test_the_leases_a_timed_out_batch_may_hold_are_given_back(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """The batch form: A's pipelined SET NXs land, their replies come late; A loads
    without writing L2, and its five leases stayed for lease_ttl (a larger batch, sent
    in chunks, can also fail after its first chunks took theirs)."""
    a_config = make_config(late_replies.url, prefix, LONG_LEASE, redis=SLOW_A)
    fields = [{"id": i} for i in range(5)]
    admin = redis.Redis.from_url(redis_url)
    async with (
        LayeredCache.from_config(a_config) as a,
        LayeredCache.from_config(make_config(redis_url, prefix, LONG_LEASE)) as b,
    ):
        late_replies.match, late_replies.delay = b"NX", 0.5
        assert await a.get_or_load_many("book", fields, lambda m: _slow(["A"] * len(m), 0)) == ["A"] * 5
        late_replies.match = None
        leases = [lease_name(a.key("book", f)) for f in fields]
        assert await eventually(lambda: _all_gone(admin, leases), timeout=1.0)
        values, took = await _timed(b.get_or_load_many("book", fields, lambda m: _slow(["B"] * len(m), 0)))
        assert values == ["B"] * 5 and took < 0.5
    await admin.aclose()


# A's Redis settings with the shipped breaker (3 failures, 1 s reset): three late SET NX
# replies open it.
# The first timeout opens A's breaker: with the shipped 3 consecutive failures, a success
# between the timeouts (another read's GET, the clock sampler's TIME, on a loaded CI
# machine) kept it closed, and the scenario tested nothing.
OPENING_BREAKER_A = {
    "timeout": "200ms", "connect_timeout": "200ms", "breaker": {"failures": 1, "reset": "1s"}
}


async def test_leases_of_late_set_nx_replies_are_given_back_also_when_the_breaker_opened(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """README, "One load per key for the fleet": "a read ... whose Redis step timed out
    after its ``SET NX`` may have landed ... gives its leases back".
    Scenario: 3 concurrent reads of 3 cold keys on instance A (the shipped breaker);
    Redis takes each SET NX at once, its reply comes 0.5 s late; the 3 timeouts open A's
    breaker; A serves its loader's values. 1 s later B, on a healthy path, reads key 0.
    Expected: A's leases were given back, B loads and fills at once.
    Happened: all 3 leases still held (pttl ~3.5 s), B waited max_wait (1.5 s). Cause:
    each give-back went through ``L2Store.guard``, which the breaker those very timeouts
    opened refused at once; now a refused give-back goes past it (``_giveback``)."""
    a_config = make_config(late_replies.url, prefix, LONG_LEASE, redis=OPENING_BREAKER_A)
    admin = redis.Redis.from_url(redis_url)
    async with (
        LayeredCache.from_config(a_config) as a,
        LayeredCache.from_config(make_config(redis_url, prefix, LONG_LEASE)) as b,
    ):
        late_replies.match, late_replies.delay = b"NX", 0.5
        reads = [a.get_or_load("book", {"id": i}, CountingLoader("from A")) for i in range(3)]
        assert await asyncio.gather(*reads) == ["from A"] * 3
        late_replies.match = None
        assert a.redis_status().breaker != "closed"  # opened by the late SET NX replies
        await asyncio.sleep(1.0)
        leases = [lease_name(a.key("book", {"id": i})) for i in range(3)]
        held = await admin.exists(*leases)
        value, took = await _timed(b.get_or_load("book", {"id": 0}, CountingLoader("from B")))
        filled = await admin.exists(b.key("book", {"id": 0}))
    await admin.aclose()
    assert held == 0, f"{held} of A's 3 leases still held 1 s after A's reads returned"
    assert value == "from B" and took < 0.5, f"B waited {took:.2f} s for a fill nobody runs"
    assert filled == 1


async def test_leases_of_late_batch_lease_replies_are_given_back_also_when_the_breaker_opened(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """README, "Batches keep every single-key guarantee": "Leases a failed or late lease
    round trip may hold are given back." The batch form of the scenario above: 3
    concurrent ``get_or_load_many`` of 3 keys each on A, their SET NX round trips late
    (the breaker opens); then B reads the 9 keys in one batch.
    Expected: none of A's 9 leases held, B fills them at once.
    Happened: all 9 still held (``BatchFill.release`` refused by the breaker), B waited
    max_wait."""
    a_config = make_config(late_replies.url, prefix, LONG_LEASE, redis=OPENING_BREAKER_A)
    admin = redis.Redis.from_url(redis_url)
    groups = [[{"id": 3 * g + i} for i in range(3)] for g in range(3)]
    async with (
        LayeredCache.from_config(a_config) as a,
        LayeredCache.from_config(make_config(redis_url, prefix, LONG_LEASE)) as b,
    ):
        late_replies.match, late_replies.delay = b"NX", 0.5
        batches = [a.get_or_load_many("book", g, lambda m: _slow(["A"] * len(m), 0)) for g in groups]
        assert await asyncio.gather(*batches) == [["A"] * 3] * 3
        late_replies.match = None
        assert a.redis_status().breaker != "closed"
        await asyncio.sleep(1.0)
        fields = [f for g in groups for f in g]
        held = await admin.exists(*[lease_name(a.key("book", f)) for f in fields])
        values, took = await _timed(b.get_or_load_many("book", fields, lambda m: _slow(["B"] * len(m), 0)))
    await admin.aclose()
    assert held == 0, f"{held} of A's 9 leases still held 1 s after A's batches returned"
    assert values == ["B"] * 9 and took < 0.5, f"B waited {took:.2f} s"


async def _scripts_run(admin: redis.Redis) -> int:
    stats = await admin.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha"))


async def test_a_batch_whose_lease_request_the_open_breaker_refused_sends_no_give_backs(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/operations.md (breaker): a lease the open breaker refused was never asked
    for: nothing to give back. Scenario: A reads 20 cold keys in one batch; its MGET
    answers, and right then another call's timeout opens A's breaker (forced here), so
    the breaker refuses the batch's lease round trip and the loader answers. Happened:
    the batch still sent 20 compare-and-deletes past the breaker (``_giveback``) for
    leases it never asked for. Noted in session 25, fixed 2026-12-06."""
    opening = {**OPENING_BREAKER_A, "breaker": {"failures": 1, "reset": "5s"}}
    a_config = make_config(redis_url, prefix, LONG_LEASE, redis=opening)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(a_config) as a:
        read_many = BatchReader.read_many

        async def read_then_breaker_opens(self: BatchReader, *args: Any, **kwargs: Any) -> Any:
            found = await read_many(self, *args, **kwargs)
            a._store.breaker.failure(TimeoutError("another call's"))
            return found

        monkeypatch.setattr(BatchReader, "read_many", read_then_breaker_opens)
        before = await _scripts_run(admin)
        fields = [{"id": i} for i in range(1, 21)]
        values = await a.get_or_load_many("book", fields, lambda m: _slow(["A"] * len(m), 0))
        await asyncio.sleep(0.5)  # give-backs run in the background
        sent = await _scripts_run(admin) - before
        assert a.redis_status().breaker == "open"
    await admin.aclose()
    assert values == ["A"] * 20
    assert sent == 0, f"{sent} scripts (give-backs) sent for leases never asked for"


async def test_give_backs_past_an_open_breaker_go_one_round_trip_at_a_time() -> None:
    """``_giveback``: during an outage each give-back the open breaker refused would
    cost a timeout against a dead Redis. Bounded: one round trip at a time carries every
    one pending, and one that fails drops the rest (they expire by themselves)."""
    from layered_cache._giveback import GiveBacks

    spawned: list[Any] = []
    give_backs = GiveBacks(None, spawned.append)  # type: ignore[arg-type]  # not used
    sent: list[list[tuple[str, str]]] = []
    gate = asyncio.Event()

    async def hung_release(pairs: list[tuple[str, str]]) -> None:
        sent.append(pairs)
        await gate.wait()
        raise TimeoutError  # Redis down

    give_backs._release = hung_release  # type: ignore[method-assign]
    for token in ("t1", "t2", "t3"):
        give_backs.past_breaker(["{k}:lease"], token)
    await asyncio.sleep(0)
    give_backs.past_breaker(["{k}:lease", "{j}:lease"], "t4")
    await asyncio.sleep(0.01)
    assert len(spawned) == 1 and sent == [[("{k}:lease", t) for t in ("t1", "t2", "t3")]]
    assert give_backs.pending == 2  # the next round trip's, after this one
    gate.set()
    await asyncio.gather(*spawned)
    assert len(sent) == 1 and give_backs.pending == 0  # dropped: Redis is failing


async def _all_gone(admin: Any, names: list[str]) -> bool:
    return bool(await admin.exists(*names) == 0)


async def _gone(admin: Any, name: str) -> bool:
    return bool(await admin.exists(name) == 0)


async def test_a_foreign_value_without_ttl_at_a_lease_name_blocks_a_key_only_for_a_lease_ttl(
    redis_url: str, prefix: str
) -> None:
    """A hash planted at ``{key}:lease`` (a tool's leftover) never expired: every miss
    of the key waited max_wait and loaded without filling L2, for good. The first wait
    that times out gives it a lease's TTL; after that the key is cached as usual."""
    ns = {"book": {"key": "book:{id}", "stampede": {"lease_ttl": "500ms", "max_wait": "300ms"}}}
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, ns)) as cache:
        lease = lease_name(cache.key("book", {"id": 1}))
        await admin.hset(lease, "left", "by a tool")
        loader = CountingLoader("db")
        assert await cache.get_or_load("book", {"id": 1}, loader) == "db"  # waited max_wait
        assert await eventually(lambda: _has_ttl(admin, lease), timeout=1.0)
        await asyncio.sleep(0.6)  # the lease's TTL passes
        cache.namespace("book").policy.l1.clear()  # type: ignore[union-attr]
        value, took = await _timed(cache.get_or_load("book", {"id": 1}, loader))
        assert value == "db" and took < 0.25
        assert await admin.exists(cache.key("book", {"id": 1})) == 1  # filled this time
    await admin.aclose()


async def _has_ttl(admin: Any, name: str) -> bool:
    return bool(await admin.pttl(name) > 0)


async def test_close_gives_back_the_lease_of_an_early_refresh_it_stops(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """close() cancels an early refresh holding the key's lease, here in its double-check
    GET under the lease (its reply slow to come, well within redis.timeout). The refresh
    gave back its lease only when Redis failed, and close() waited for no task spawned
    once it had cancelled: the lease stayed for lease_ttl (20 s), and every other
    instance's miss of the key waited for it (max_wait), then loaded without writing L2.
    Found by a review; failed before its fix."""
    book = {
        "key": "book:{id}",
        "l1": False,
        "l2": {"ttl": "10s", "jitter": 0},
        "stampede": {"early_refresh_beta": 1.0, "lease_ttl": "20s"},
    }
    config = make_config(late_replies.url, prefix, {"book": book}, redis={"timeout": "3s"})
    admin = redis.Redis.from_url(redis_url)
    cache = LayeredCache.from_config(config, rand=lambda: 1 - 1e-12)  # every hit refreshes
    await cache.start()
    acquire = cache._store.acquire_lease

    async def won_then_late(*args: Any) -> bool:
        won: bool = await acquire(*args)
        late_replies.match, late_replies.delay = b"GET", 2.0  # the double-check's reply
        return won

    try:
        assert await cache.get_or_load("book", {"id": 1}, lambda: _slow("old", 0.5)) == "old"
        cache._store.acquire_lease = won_then_late  # type: ignore[method-assign]
        matched = late_replies.matched
        # An L2 hit that starts an early refresh in the background.
        assert await cache.get_or_load("book", {"id": 1}, lambda: _slow("new")) == "old"
        assert await eventually(lambda: late_replies.matched > matched, timeout=2.0)
        late_replies.match = None  # the refresh holds the lease, its GET's reply is late
    finally:
        await cache.close()
    lease = lease_name(cache.key("book", {"id": 1}))
    held, ttl = await admin.get(lease), await admin.pttl(lease)
    await admin.aclose()
    assert held is None, f"close() left the refresh's lease for {ttl} ms more"



async def _nothing(current: object) -> None:
    return None


async def test_django_steps_that_timed_out_give_lock_and_lease_back_past_the_open_breaker(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """docs/operations.md (breaker): "One thing goes past an open breaker: a lease a
    timed-out request may hold given back"; README, "One load per key for the fleet": "a
    give-back the open breaker refuses goes past it"; docs/django.md: add / incr / touch
    "releases both with a compare-and-delete".
    Scenario: 3 concurrent Django read-modify-write steps (``_django_locked.locked``, as
    ``incr``/``add``/``touch`` run) of 3 keys on instance A (the shipped breaker): each
    takes the key's lock and lease, then its L2 read's reply comes 0.5 s late (>
    redis.timeout): the 3 timeouts open A's breaker. 1 s later B get_or_load()s key 0.
    Expected: A's locks and leases given back; B loads and fills at once.
    Happened: all stayed for lease_ttl; B waited max_wait (1.5 s) and loaded without
    filling L2. Cause: ``_django_locked._release`` gave back through ``L2Store.release``
    (the breaker's guard) and swallowed its ``BreakerOpen``, where ``MissPath.release``
    goes past it (``Runtime.give_backs``). Found by a review (fixes2); failed before."""
    a_config = make_config(late_replies.url, prefix, LONG_LEASE, redis=OPENING_BREAKER_A)
    admin = redis.Redis.from_url(redis_url)
    async with (
        LayeredCache.from_config(a_config) as a,
        LayeredCache.from_config(make_config(redis_url, prefix, LONG_LEASE)) as b,
    ):
        late_replies.match, late_replies.delay = b"GET", 0.5
        steps = [locked(a, "book", {"id": str(i)}, _nothing) for i in range(3)]
        outcomes = await asyncio.gather(*steps, return_exceptions=True)
        late_replies.match = None
        assert all(isinstance(o, L2Unavailable) for o in outcomes), outcomes
        assert a.redis_status().breaker != "closed"  # opened by the late GET replies
        await asyncio.sleep(1.0)
        keys = [a.key("book", {"id": str(i)}) for i in range(3)]
        leases = await admin.exists(*[lease_name(k) for k in keys])
        locks = await admin.exists(*[lock_name(k) for k in keys])
        value, took = await _timed(b.get_or_load("book", {"id": "0"}, CountingLoader("from B")))
    await admin.aclose()
    assert leases == 0 and locks == 0, f"{leases} leases, {locks} locks still held 1 s later"
    assert value == "from B" and took < 0.5, f"B waited {took:.2f} s for a fill nobody runs"


async def test_a_django_step_whose_lease_set_nx_reply_was_late_gives_the_lease_back(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """README, "Batches keep every single-key guarantee": "Leases a failed or late lease
    round trip may hold are given back"; docs/django.md: add / incr / touch "releases
    both with a compare-and-delete".
    Scenario: a Django read-modify-write step (``_django_locked.locked``) on instance A
    takes the key's lock; the SET NX of the key's lease lands in Redis, its reply comes
    0.5 s late (> redis.timeout; breaker left closed): the step raises L2Unavailable.
    0.6 s later B get_or_load()s the key.
    Expected: A gave the lease (and lock) back, as a timed-out read does; B loads at once.
    Happened: the lease stayed for lease_ttl (5 s): B waited max_wait (1.5 s) and loaded
    without filling L2. Cause: ``locked`` released only the names whose SET NX reply it
    had read; a late or cancelled one was never given back. Found by a review (fixes2);
    failed before its fix."""
    a_config = make_config(late_replies.url, prefix, LONG_LEASE, redis=SLOW_A)
    admin = redis.Redis.from_url(redis_url)
    async with (
        LayeredCache.from_config(a_config) as a,
        LayeredCache.from_config(make_config(redis_url, prefix, LONG_LEASE)) as b,
    ):
        late_replies.match, late_replies.delay = b"}:lease", 0.5
        with pytest.raises(L2Unavailable):
            await locked(a, "book", {"id": "1"}, _nothing)
        late_replies.match = None
        await asyncio.sleep(0.6)  # the late reply has come; A has had time to give back
        key = a.key("book", {"id": "1"})
        held = await admin.exists(lease_name(key), lock_name(key))
        value, took = await _timed(b.get_or_load("book", {"id": "1"}, CountingLoader("from B")))
    await admin.aclose()
    assert held == 0, "A's lease or lock still held after its step raised"
    assert value == "from B" and took < 0.5, f"B waited {took:.2f} s for a fill nobody runs"
