"""What the schedule explorer found in the tag paths and the stale fail-safe
(docs/explorer.md, "What the new operations found"), each as one deterministic scenario
against a real Redis. Each failed before its fix (named in docs/explorer.md) and guards
it now."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import redis.asyncio.client as redis_client

from layered_cache import LayeredCache
from layered_cache import _direct as direct
from layered_cache._l2 import L2Unavailable
from tests.helpers import make_config

NAMESPACES = {"category": {"key": "category:{slug}", "tags": True}}
SCIFI = {"slug": "scifi"}


def _page(edition: int) -> dict[str, Any]:
    return {"books": [42], "edition": edition, "shape": (edition, "scifi")}


def _tags_of(page: Mapping[str, Any]) -> list[str]:
    return [f"book:{b}" for b in page["books"]]


async def _connected(*caches: LayeredCache) -> None:
    for cache in caches:
        assert cache._backplane is not None
        await asyncio.wait_for(cache._backplane.connected.wait(), 5)


async def _until(predicate: Any, limit: float = 5.0) -> None:
    for _ in range(int(limit / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


class Hold:
    """Once armed, the next command ``name`` (``PIPELINE`` for a pipeline) on ``key``
    (any key if None) is held until ``release`` is set: ``before`` it is sent, or
    ``after`` Redis answered it (the explorer's "slow reply" window)."""

    def __init__(self) -> None:
        self.armed: tuple[str, str | None, str] | None = None
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    def arm(self, name: str, key: str | None = None, when: str = "after") -> None:
        self.arrived.clear()
        self.release.clear()
        self.armed = (name, key, when)

    async def point(self, name: str, args: tuple[Any, ...], when: str) -> None:
        if self.armed is None:
            return
        wanted, key, at = self.armed
        named = args[1] if len(args) > 1 else None
        if isinstance(named, bytes):
            named = named.decode()
        if wanted == name and at == when and (key is None or key == named):
            self.armed = None
            self.arrived.set()
            await self.release.wait()


def _held(send: Any, held: Hold) -> Any:
    """``send`` (a command: its first argument is the client, then the command's
    name and arguments) with ``held``'s points before and after it."""

    async def command(client: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(args[0]).upper()
        await held.point(name, args, "before")
        result = await send(client, *args, **kwargs)
        await held.point(name, args, "after")
        return result

    return command


@pytest.fixture
def hold() -> Iterator[Hold]:
    command, pipeline = redis_client.Redis.execute_command, redis_client.Pipeline.execute
    packed = direct.execute_command  # GET and set()'s write on a single node
    listener_reads = direct.HeldConnection.execute  # the listener's stream commands
    held = Hold()

    async def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        await held.point("PIPELINE", (), "before")
        result = await pipeline(self, *args, **kwargs)
        await held.point("PIPELINE", (), "after")
        return result

    redis_client.Redis.execute_command = _held(command, held)  # type: ignore[method-assign]
    redis_client.Pipeline.execute = execute  # type: ignore[method-assign]
    direct.execute_command = _held(packed, held)
    direct.HeldConnection.execute = _held(listener_reads, held)  # type: ignore[method-assign]
    try:
        yield held
    finally:
        held.release.set()
        redis_client.Redis.execute_command = command  # type: ignore[method-assign]
        redis_client.Pipeline.execute = pipeline  # type: ignore[method-assign]
        direct.execute_command = packed
        direct.HeldConnection.execute = listener_reads  # type: ignore[method-assign]


async def test_a_tag_version_fetched_before_an_invalidation_does_not_overwrite_the_newer_one(
    redis_url: str, prefix: str, hold: Hold
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    async with (
        LayeredCache.from_config(config) as writer,
        LayeredCache.from_config(config) as reader,
    ):
        await _connected(writer, reader)
        await writer.set("category", SCIFI, _page(1), tags=["book:42"])
        hold.arm("PIPELINE")
        # The reader has never seen book:42: its get fetches the version (one pipeline),
        # whose reply is held after Redis answered it with the old version...
        reading = asyncio.ensure_future(reader.get("category", SCIFI))
        await asyncio.wait_for(hold.arrived.wait(), 5)
        listener = reader._backplane
        assert listener is not None
        seen = listener.entries_seen
        await writer.invalidate_tag("book:42")  # ...while the tag is invalidated
        await _until(lambda: listener.entries_seen > seen)  # the reader was told
        hold.release.set()
        await reading  # began before the invalidation: either answer is allowed
        # Afterwards the old page is dead for the reader as for everyone else.
        assert await writer.get("category", SCIFI) is None
        assert await reader.get("category", SCIFI) is None


async def test_callers_after_invalidate_tag_do_not_join_a_load_that_began_before_it(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    gate, started = asyncio.Event(), asyncio.Event()

    async def old_page() -> dict[str, Any]:
        started.set()
        await gate.wait()
        return _page(1)  # read from the database before the change

    async def new_page() -> dict[str, Any]:
        return _page(2)

    async with LayeredCache.from_config(config) as cache:
        loading = asyncio.ensure_future(
            cache.get_or_load("category", SCIFI, old_page, tags=_tags_of)
        )
        await asyncio.wait_for(started.wait(), 5)
        await cache.invalidate_tag("book:42")  # the price of book 42 changed
        later = asyncio.ensure_future(cache.get_or_load("category", SCIFI, new_page, tags=_tags_of))
        await asyncio.sleep(0.05)
        gate.set()
        await loading
        assert (await later)["edition"] == 2


async def test_a_tagged_load_whose_version_fetch_fails_returns_the_l2_type(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)

    async def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise L2Unavailable("explorer: the tag versions' pipeline failed")

    async def load() -> dict[str, Any]:
        return _page(1)

    async def load_many(fields_list: list[Any]) -> list[Any]:
        return [_page(1) for _ in fields_list]

    async with LayeredCache.from_config(config) as cache:
        monkeypatch.setattr(cache._rt.versions, "current", unavailable)
        single = await cache.get_or_load("category", SCIFI, load, tags=_tags_of)
        [batch] = await cache.get_or_load_many(
            "category", [{"slug": "poetry"}], load_many, tags=_tags_of
        )
        # L2 hands out a list for the tuple: so must every other answer of the call.
        assert isinstance(single["shape"], list)
        assert isinstance(batch["shape"], list)


async def test_concurrent_invalidate_tag_calls_leave_every_instance_on_the_version_redis_holds(
    redis_url: str, prefix: str, hold: Hold
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    async with (
        LayeredCache.from_config(config) as a,
        LayeredCache.from_config(config) as b,
    ):
        await _connected(a, b)
        hold.arm("XADD", when="before")  # a's backplane entry waits...
        first = asyncio.ensure_future(a.invalidate_tag("book:42"))
        await asyncio.wait_for(hold.arrived.wait(), 5)
        await b.invalidate_tag("book:42")  # ...while b's version is set and announced
        hold.release.set()
        await first  # both returned: Redis holds b's version (the last SET)
        await asyncio.sleep(0.3)  # every entry delivered to both instances
        await b.set("category", SCIFI, _page(2), tags=["book:42"])
        async with LayeredCache.from_config(config) as fresh:
            pages = [await c.get("category", SCIFI) for c in (a, b, fresh)]
        # A page written after both invalidations is alive for everyone.
        assert [p is not None and p["edition"] for p in pages] == [2, 2, 2]


async def test_a_fallback_is_not_served_once_an_invalidation_arrived_during_its_recheck(
    redis_url: str, prefix: str, hold: Hold
) -> None:
    namespaces = {
        "book": {
            "key": "book:{id}",
            "l1": {"ttl": "30ms"},
            "l2": {"ttl": "30ms", "jitter": 0.0},
            "stale": {"max_age": "30s"},
            "stampede": {"load_timeout": "3ms"},
        }
    }
    config = make_config(redis_url, prefix, namespaces)
    gate, started = asyncio.Event(), asyncio.Event()

    async def new_value() -> dict[str, int]:
        started.set()
        await gate.wait()
        return {"v": 2}

    async with (
        LayeredCache.from_config(config) as a,
        LayeredCache.from_config(config) as b,
    ):
        await _connected(a, b)
        await a.set("book", {"id": 1}, {"v": 1})
        await asyncio.sleep(0.05)  # soft-expired: a stale value the fail-safe may serve
        reading = asyncio.ensure_future(a.get_or_load("book", {"id": 1}, new_value))
        await asyncio.wait_for(started.wait(), 5)
        # After load_timeout the fail-safe re-reads L2: Redis answers with v1...
        hold.arm("GET", a.key("book", {"id": 1}))
        await asyncio.wait_for(hold.arrived.wait(), 5)
        await b.invalidate("book", {"id": 1})  # ...and then v1 is invalidated
        await asyncio.sleep(0.2)  # a's backplane delivered it: a knows
        hold.release.set()
        gate.set()
        # The read returns after a was told: an invalidated value is never a fallback.
        assert await reading == {"v": 2}


async def test_an_early_refresh_still_loading_when_a_batch_returns_is_not_the_batchs_load(
    redis_url: str, prefix: str
) -> None:
    """Found on a loaded machine (seed 20262188, ``stale`` variant): a batch answered a
    key from L2 while set() of it ran; XFetch refreshed the key with the batch's loader
    in the background, still loading when the batch returned, and the explorer took that
    load for the batch's own: the L2 value looked like a fallback, held to the fallback
    rule, and was reported as superseded. Not a library bug: the explorer now tells the
    refresh's loads apart (``in_early_refresh``), and this pins that it can."""
    from tests.explorer.scheduler import yield_points
    from tests.explorer.world import in_early_refresh

    stampede = {"early_refresh_beta": 100.0}
    namespaces = {"book": {"key": "book:{id}", "l1": False, "l2": {"ttl": "1s", "jitter": 0.0},
                           "stampede": stampede}}
    release = asyncio.Event()
    refreshing: list[bool] = []

    async def load_many(fields_list: list[dict[str, Any]]) -> list[Any]:
        refreshing.append(in_early_refresh())
        if refreshing[-1]:
            await release.wait()  # the refresh: held until the batches have returned
        else:
            await asyncio.sleep(0.05)  # XFetch scales the refresh odds by the load time
        return [{"id": fields["id"]} for fields in fields_list]

    with yield_points():
        await _refresh_while_batches_read(redis_url, prefix, namespaces, load_many, refreshing)
    release.set()


async def _refresh_while_batches_read(
    redis_url: str, prefix: str, namespaces: dict[str, Any], load_many: Any, refreshing: list[bool]
) -> None:
    from layered_cache._batch_load import one_loader

    async with LayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:
        # Filled by a single read: a batch fill records no load time (delta 0), and XFetch
        # never refreshes such an entry early; a single get_or_load records it.
        first = await cache.get_or_load("book", {"id": 1}, one_loader("book", {"id": 1}, load_many))
        assert first == {"id": 1}
        for _ in range(50):  # each L2 hit refreshes early with odds of about 4 in 5
            got = await asyncio.wait_for(cache.get_or_load_many("book", [{"id": 1}], load_many), 2)
            assert got == [{"id": 1}]
            await asyncio.sleep(0.01)  # let a spawned refresh reach the loader
            if True in refreshing:
                break
        assert refreshing[0] is False and True in refreshing, refreshing
