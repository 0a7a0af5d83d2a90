"""Whatever bytes sit at a key are read as a miss, counted, and overwritten by the next
fill: a value nested deeper than the interpreter's stack, timestamps no clock shows
(NaN, infinity), a fallback message built to exhaust the decoder. Each of these once
raised out of a read, or made the layers disagree about one key."""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import structlog

from layered_cache import LayeredCache
from layered_cache._codec import Codec, CodecError
from layered_cache.cli import main
from layered_cache.sync import SyncLayeredCache
from tests.helpers import CountingLoader, eventually, in_l1, make_config
from tests.servers import RedisServer
from tests.test_cli import write_config

ENC = msgspec.msgpack.encode
DEEP = b"\x91" * 2000 + b"\xc0"  # a list in a list ... 2,000 deep: ~2 KB


def nested_envelope() -> bytes:
    """A valid envelope header around a value nested 2,000 deep."""
    now = time.time()
    return b"\x95\x01" + DEEP + ENC(now) + ENC(now + 300) + ENC(0.01)


def envelope(value: Any, written_at: float, soft_expiry: float, delta: float) -> bytes:
    return ENC((1, value, written_at, soft_expiry, delta))


@pytest.fixture
def admin(redis_url: str) -> Any:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


class Book(msgspec.Struct):
    id: int
    title: str


def test_the_codec_reads_a_value_nested_past_the_stack_as_not_an_envelope() -> None:
    """msgspec recursed into it and RecursionError escaped every read; a declared type
    recurses too, to skip an unknown field or an extra element (Django's entries)."""
    from layered_cache._django_values import Entry

    unknown_field = b"\x83" + ENC("id") + ENC(1) + ENC("title") + ENC("t") + ENC("junk") + DEEP
    extra_element = b"\x93" + ENC(b"payload") + ENC(None) + DEEP
    tail = ENC(1.0) + ENC(2e9) + ENC(0.1)
    cases: list[tuple[Codec[Any], bytes]] = [
        (Codec(), DEEP), (Codec(Book), unknown_field), (Codec(Entry), extra_element)]
    for codec, value in cases:
        with pytest.raises(CodecError):
            codec.decode(b"\x95\x01" + value + tail)


async def test_a_msgpack_extension_another_writer_planted_is_a_miss_then_overwritten(
    redis_url: str, prefix: str, admin: Any
) -> None:
    """The codec never writes an extension type: an undeclared namespace served one as a
    ``msgspec.msgpack.Ext`` object (the ASGI helper's JSON could not render it). A
    datetime, which msgspec writes as its own timestamp extension, still round-trips."""
    now = time.time()
    admin.set(f"{prefix}book:1", envelope([1, msgspec.msgpack.Ext(5, b"x")], now, now + 300, 0.01))
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as cache, LayeredCache.from_config(config) as other:
        assert await cache.get("book", {"id": 1}) is None
        assert cache.stats()["book"]["decode_error"] == 1
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("fresh")) == "fresh"
        when = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)
        await cache.set("book", {"id": 2}, {"published": when})
        assert await other.get("book", {"id": 2}) == {"published": when}  # from L2
    assert msgspec.msgpack.decode(admin.get(f"{prefix}book:1"))[1] == "fresh"  # repaired


async def test_a_value_nested_past_the_stack_is_a_miss_for_every_read_then_overwritten(
    redis_url: str, prefix: str, admin: Any
) -> None:
    for i in range(1, 5):
        admin.set(f"{prefix}book:{i}", nested_envelope())

    async def load_many(missing: list[dict[str, Any]]) -> list[Any]:
        return [f"v{f['id']}" for f in missing]

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert await cache.get("book", {"id": 1}) is None
        assert await cache.get_many("book", [{"id": 2}]) == [None]
        assert await cache.get_or_load("book", {"id": 3}, CountingLoader("fresh")) == "fresh"
        assert await cache.get_or_load_many("book", [{"id": 4}], load_many) == ["v4"]
        assert cache.stats()["book"]["decode_error"] >= 4
    assert msgspec.msgpack.decode(admin.get(f"{prefix}book:3"))[1] == "fresh"  # repaired
    assert msgspec.msgpack.decode(admin.get(f"{prefix}book:4"))[1] == "v4"


def test_a_value_nested_past_the_stack_is_a_miss_for_the_sync_api(
    redis_url: str, prefix: str, admin: Any
) -> None:
    admin.set(f"{prefix}book:6", nested_envelope())
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert cache.get("book", {"id": 6}) is None
        assert cache.get_or_load("book", {"id": 6}, lambda: "fresh") == "fresh"


@pytest.mark.parametrize("field", ["written_at", "soft_expiry", "delta"])
@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
async def test_an_envelope_with_a_time_no_clock_shows_is_a_miss_for_every_read(
    redis_url: str, prefix: str, admin: Any, field: str, number: float
) -> None:
    """soft_expiry NaN was fresh for get() (``now >= NaN`` is false), stale for
    get_many(), and get() put it in L1, where get_or_load() then served it; written_at
    NaN made an early refresh take the lease and stand down on every read (NaN != NaN
    read as "refreshed meanwhile")."""
    now = time.time()
    times = {"written_at": now, "soft_expiry": now + 300, "delta": 0.01, field: number}
    admin.set(f"{prefix}book:9", envelope("planted", *times.values()), px=60_000)
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert await cache.get("book", {"id": 9}) is None
        assert await cache.get_many("book", [{"id": 9}]) == [None]
        assert await cache.get_or_load("book", {"id": 9}, CountingLoader("fresh")) == "fresh"
    assert msgspec.msgpack.decode(admin.get(f"{prefix}book:9"))[1] == "fresh"


@pytest.mark.parametrize(
    ("written_at", "shown"),
    [(1e12, "(not a date)"), (1e17, "(not a date)"), (float("nan"), "not a layered_cache envelope"),
     (None, "not a layered_cache envelope")],
)
def test_inspect_of_a_planted_envelope_reports_it(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any,
    capsys: pytest.CaptureFixture[str], written_at: float | None, shown: str,
) -> None:
    """A year no calendar holds ended in "Redis failed: OSError" or a traceback; a value
    nested past the stack in a traceback."""
    data = nested_envelope() if written_at is None else envelope("v", written_at, 2e9, 0.1)
    admin.set(f"{prefix}book:8", data)
    assert main(["inspect", "book", "id=8", "--config", str(write_config(tmp_path, redis_url, prefix))]) == 0
    captured = capsys.readouterr()
    assert shown in captured.out and "Traceback" not in captured.err


async def test_a_fallback_message_nested_past_the_stack_does_not_end_the_subscriber(
    redis_url: str, prefix: str
) -> None:
    """It did: this instance never again heard an invalidation sent over the fallback."""
    from layered_cache._fallback import FallbackMessage, fallback_channel

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert cache._fallback is not None
        assert await eventually(cache._fallback.subscribed.is_set)
        channel = fallback_channel(prefix + cache.config.backplane.stream)
        client = cache._store.client
        poison = b"\x82" + ENC("keys") + ENC([]) + ENC("junk") + DEEP  # skipped: recursed
        await client.publish(channel, poison)
        await asyncio.sleep(0.3)
        await cache.get_or_load("book", {"id": 20}, CountingLoader("v"))
        assert in_l1(cache, 20)
        message = FallbackMessage(keys=[f"{prefix}book:20"], origin="another")
        await client.publish(channel, ENC(message))
        assert await eventually(lambda: not in_l1(cache, 20), timeout=3)


async def test_a_type_declared_after_reads_is_what_l1_hits_return_too(
    redis_url: str, prefix: str
) -> None:
    """A module with a cached function imported after start(): L1 kept the plain dicts
    decoded before the declaration, so L1 hits returned a dict where every other layer
    now returned the declared Struct."""
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        async def raw() -> Any:
            return Book(50, "Dune")

        assert type(await cache.get_or_load("book", {"id": 50}, raw)) is dict  # in L1

        @cache.cached("book")
        async def book_detail(id: int) -> Book:
            return Book(id, "Dune")

        assert type(await book_detail(51)) is Book
        assert await book_detail(50) == Book(50, "Dune")  # L1 had the dict


async def test_a_waiter_counts_a_fill_it_cannot_decode_once_not_at_every_poll(
    redis_url: str, prefix: str, admin: Any
) -> None:
    """Another process holds the lease and its fill is bytes this one cannot decode (a
    deploy with another value type): each of the waiter's re-reads counted it, so
    ``decode_error`` grew with max_wait / reread_pause for one request."""
    namespaces = {"book": {"key": "book:{id}", "stampede": {
        "lease_ttl": "5s", "max_wait": "600ms", "reread_pause": ["20ms", "30ms"]}}}
    admin.set(f"{{{prefix}book:1}}:lease", "another-process", px=5000)
    async with LayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:
        waiting = asyncio.ensure_future(cache.get_or_load("book", {"id": 1}, CountingLoader("v")))
        await asyncio.sleep(0.1)
        admin.set(f"{prefix}book:1", b"\xc1 not an envelope")
        assert await waiting == "v"  # max_wait passed: loaded without the lease
        assert cache.stats()["book"]["decode_error"] == 1


class OldBook(msgspec.Struct):
    id: int
    title: str


class RenamedBook(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    name: str = ""


async def test_a_renamed_field_is_a_miss_with_forbid_unknown_fields(
    redis_url: str, prefix: str, admin: Any
) -> None:
    """What the README advises for a field renamed across a deploy: values the old code
    wrote are misses, reloaded, never served with the new field at its default."""
    now = time.time()
    admin.set(f"{prefix}book:1", envelope(OldBook(1, "Dune"), now, now + 300, 0.01))
    types = {"book": RenamedBook}
    async with LayeredCache.from_config(make_config(redis_url, prefix), value_types=types) as cache:
        fresh = await cache.get_or_load("book", {"id": 1}, CountingLoader(RenamedBook(1, "Dune")))
        assert fresh == RenamedBook(1, "Dune")
        assert cache.stats()["book"]["decode_error"] == 1


async def test_a_foreign_100_mb_value_is_a_miss_overwritten_not_a_redis_failure(
    prefix: str,
) -> None:
    """Another tool wrote 100 MB at a cache key (no namespace writes more than its
    max_value_bytes, 1 MB by default). Read whole, each GET took 250-390 ms here: past
    the default redis.timeout (100 ms) a Redis failure, two of which opened the breaker
    for every key, and the value was never replaced. Now the read stops after a cap, as
    for a key of the wrong type: a miss, the node counted healthy, the fill overwrites
    it (~90 ms, most of it Redis copying the value into its output buffer before the
    first byte). The timeout here is 1 s, so that what is checked is that the read
    stopped (no decode of 100 MB), not a race with the clock. Single node (a cluster's
    GETs go through redis-py)."""
    with RedisServer() as server, structlog.testing.capture_logs() as logs:
        admin = redis.Redis.from_url(server.url)
        admin.set(f"{prefix}book:1", b"x" * 100_000_000)
        config = make_config(server.url, prefix, redis={"timeout": "1s"})
        async with LayeredCache.from_config(config) as cache:
            assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
            stats = cache.stats()["book"]
            assert stats["redis_error"] == 0 and stats["decode_error"] == 0, stats
        assert admin.strlen(f"{prefix}book:1") < 1000  # overwritten by the fill
        admin.close()
    stopped = [e for e in logs if e["event"] == "l2_key_error"]
    assert any("a reply of more than" in e["error"] for e in stopped), logs


class PriceBelowZero(Exception):
    """The new deploy's domain error for an invalid book."""


class CheckedBook(msgspec.Struct, frozen=True):
    id: int
    price: int

    def __post_init__(self) -> None:  # added in the new deploy
        if self.price < 0:
            raise PriceBelowZero(f"book {self.id} has price {self.price}")


def old_envelope(value: Any) -> bytes:
    """What the previous deploy wrote: the library's envelope, before the invariant."""
    now = time.time()
    return msgspec.msgpack.encode((1, value, now, now + 300, 0.01))


@pytest.mark.parametrize("read", ["get_or_load", "get", "get_many"])
async def test_a_value_the_new_types_invariant_refuses_is_a_miss_then_overwritten(
    redis_url: str, prefix: str, read: str
) -> None:
    """Found by a review (2026-12-06). README, "Changing a declared type across a
    deploy": a value that no longer fits is "undecodable: a miss, counted as
    `decode_error`, reloaded and overwritten". Scenario: the new deploy's Struct gained a
    ``__post_init__`` raising an error of its own; L2 holds a value the old code wrote
    that it refuses. Happened: that error came out of every read until the L2 TTL ended
    (msgspec wraps only TypeError/ValueError as ValidationError)."""
    admin = redis.Redis.from_url(redis_url)
    admin.set(f"{prefix}book:1", old_envelope({"id": 1, "price": -5}))
    types = {"book": CheckedBook}
    async with LayeredCache.from_config(make_config(redis_url, prefix), value_types=types) as cache:
        loader = CountingLoader(CheckedBook(1, 990))
        if read == "get_or_load":
            assert await cache.get_or_load("book", {"id": 1}, loader) == CheckedBook(1, 990)
            assert loader.calls == 1
        elif read == "get":
            assert await cache.get("book", {"id": 1}) is None  # a miss, not an exception
        else:
            assert await cache.get_many("book", [{"id": 1}]) == [None]
        assert cache.stats()["book"]["decode_error"] == 1
        await cache.get_or_load("book", {"id": 1}, loader)  # the fill overwrites it
    async with LayeredCache.from_config(make_config(redis_url, prefix), value_types=types) as cache:
        assert await cache.get("book", {"id": 1}) == CheckedBook(1, 990)
    admin.close()
