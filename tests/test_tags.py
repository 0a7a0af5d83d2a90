"""Tags: a list page dies with the books it shows. Against a real Redis: every entry
carrying an invalidated tag stops being served, in L2 and every instance's L1, in a
number of round trips that doesn't grow with the entries, and a load that began before
the invalidation never lands."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis

from layered_cache import LayeredCache, _tags
from layered_cache._codec import MAX_TAGS, Codec, CodecError, decode_meta
from layered_cache._config import EventRoute
from layered_cache._keys import tag_version_name
from layered_cache.daemon.deletes import Deleter
from layered_cache.daemon.stats import DaemonStats
from tests.helpers import CountingLoader, eventually, make_config, start_checks_done
from tests.servers import RedisServer

NAMESPACES = {
    "book": {"key": "book:{id}"},
    "category": {"key": "category:{slug}", "tags": True},
}


def _page(slug: str, books: list[int], edition: int = 1) -> dict[str, Any]:
    return {"slug": slug, "books": books, "edition": edition}


def _tags_of(page: Mapping[str, Any]) -> list[str]:
    return [f"book:{b}" for b in page["books"]]


# Not the operation's: the test's own INFO, the instance's clock sync (TIME every 30 s),
# its memory-policy check (CONFIG GET), and what redis-py sends on a new connection
# (HELLO, CLIENT SETINFO, PING) when a slow machine makes the pool open one more: each
# can land in the measured window.
_NOT_COUNTED = (
    "cmdstat_info",
    "cmdstat_time",
    "cmdstat_config",
    "cmdstat_hello",
    "cmdstat_client",
    "cmdstat_ping",
)


async def _total_commands(admin: redis.Redis) -> int:
    stats = await admin.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if not k.startswith(_NOT_COUNTED))


async def _connected(*caches: LayeredCache) -> None:
    for cache in caches:
        assert cache._backplane is not None
        await asyncio.wait_for(cache._backplane.connected.wait(), 5)


async def test_invalidate_tag_kills_every_tagged_entry_in_l2_and_every_instances_l1(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    async with (
        LayeredCache.from_config(config) as a,
        LayeredCache.from_config(config) as b,
    ):
        await _connected(a, b)
        scifi, poetry = CountingLoader(_page("scifi", [42, 7])), CountingLoader(_page("poetry", [9]))
        for cache in (a, b):  # both instances hold both pages in L1
            await cache.get_or_load("category", {"slug": "scifi"}, scifi, tags=_tags_of)
            await cache.get_or_load("category", {"slug": "poetry"}, poetry, tags=_tags_of)
        assert scifi.calls == 1 and poetry.calls == 1
        await a.invalidate_tag("book:42")  # the price of book 42 changed
        scifi.value = _page("scifi", [42, 7], edition=2)
        assert (await a.get_or_load("category", {"slug": "scifi"}, scifi, tags=_tags_of))[
            "edition"
        ] == 2
        for _ in range(100):  # b learns it through the backplane
            page = await b.get("category", {"slug": "scifi"})
            if page is None or page["edition"] == 2:
                break
            await asyncio.sleep(0.02)
        assert page is None or page["edition"] == 2
        # The page without book 42 is untouched, in both instances' L1.
        for cache in (a, b):
            assert await cache.get("category", {"slug": "poetry"}) == _page("poetry", [9])
        assert poetry.calls == 1 and scifi.calls == 2


@pytest.mark.parametrize("loads", [0, 1], ids=["no_load_in_flight", "a_load_in_flight"])
@pytest.mark.parametrize("entries", [1, 1000])
async def test_invalidate_tag_costs_the_same_round_trips_for_1_and_1000_entries(
    prefix: str, entries: int, loads: int
) -> None:
    # A server of its own: on the suite's shared one, work another test left running
    # (a background release, a late fill) can land in the counted window (CI saw 10).
    with RedisServer() as server:
        await _count_invalidate_tag(server.url, prefix, entries, loads)


async def _count_invalidate_tag(redis_url: str, prefix: str, entries: int, loads: int) -> None:
    config = make_config(redis_url, prefix, NAMESPACES, backplane={"enabled": False})
    admin = redis.Redis.from_url(redis_url)
    gate, started = asyncio.Event(), asyncio.Event()

    async def held_page() -> dict[str, Any]:
        started.set()
        await gate.wait()
        return _page("held", [42])

    async with LayeredCache.from_config(config) as cache:
        for slug in range(entries):
            await cache.set("category", {"slug": str(slug)}, _page(str(slug), [42]), tags=["book:42"])
        loading = [
            asyncio.ensure_future(
                cache.get_or_load("category", {"slug": "held"}, held_page, tags=_tags_of)
            )
            for _ in range(loads)
        ]
        if loads:
            await asyncio.wait_for(started.wait(), 5)
        await start_checks_done(admin)  # CI saw their MULTI/EXEC in the window: 6
        before = await _total_commands(admin)
        await cache.invalidate_tag("book:42")
        spent = await _total_commands(admin) - before
        # SMEMBERS of the loading set; SET the version. With a tagged load in flight, in
        # between: DEL of its lease, then SREM of its member. One command per round trip,
        # the same for 1 and for 1,000 entries.
        assert spent == (4 if loads else 2), spent
        gate.set()
        await asyncio.gather(*loading)
        assert await cache.get_many("category", [{"slug": str(s)} for s in range(entries)]) == [
            None
        ] * entries
    await admin.aclose()


async def test_a_tagged_load_that_began_before_invalidate_tag_never_lands(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    gate = asyncio.Event()
    started = asyncio.Event()

    async def slow_old_page() -> dict[str, Any]:
        started.set()
        await gate.wait()
        return _page("scifi", [42], edition=1)  # read from the database before the change

    async with (
        LayeredCache.from_config(config) as loader_side,
        LayeredCache.from_config(config) as other,
    ):
        await _connected(loader_side, other)
        loading = asyncio.ensure_future(
            loader_side.get_or_load("category", {"slug": "scifi"}, slow_old_page, tags=_tags_of)
        )
        await asyncio.wait_for(started.wait(), 5)
        await other.invalidate_tag("book:42")
        gate.set()
        await loading  # the caller still gets its value...
        fresh = CountingLoader(_page("scifi", [42], edition=2))
        # ...but nobody is served it afterwards: not from L2, not from the loader's L1.
        for cache in (other, loader_side):
            page = await cache.get_or_load("category", {"slug": "scifi"}, fresh, tags=_tags_of)
            assert page["edition"] == 2
        assert fresh.calls == 1
        assert loader_side.stats()["category"]["fill_revoked"] == 1


async def test_set_with_tags_and_batches_with_tags_die_with_the_tag(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)

    async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
        return [_page(str(f["slug"]), [42]) for f in fields_list]

    async with LayeredCache.from_config(config) as cache:
        await cache.set("category", {"slug": "a"}, _page("a", [42]), tags=["book:42"])
        pages = await cache.get_or_load_many(
            "category", [{"slug": "b"}, {"slug": "c"}], load_many, tags=_tags_of
        )
        assert [p["slug"] for p in pages] == ["b", "c"]
        slugs = [{"slug": s} for s in "abc"]
        assert None not in await cache.get_many("category", slugs)
        await cache.invalidate_tag("book:42")
        assert await cache.get_many("category", slugs) == [None, None, None]


@pytest.mark.parametrize("where", ["here", "on_another_instance"])
async def test_a_batch_read_through_after_invalidate_tag_loads_the_new_value(
    redis_url: str, prefix: str, where: str
) -> None:
    """The batch's double-check under its lease (a fill may land between its MGET and
    its SET NX) must judge a tagged entry as the MGET did: it found the dead copy that
    the MGET had refused, and served it (the schedule explorer's CI find)."""
    config = make_config(redis_url, prefix, NAMESPACES)
    edition = 1

    async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
        return [_page(str(f["slug"]), [42], edition) for f in fields_list]

    async with (
        LayeredCache.from_config(config) as reader,
        LayeredCache.from_config(config) as other,
    ):
        await _connected(reader, other)
        await reader.set("category", {"slug": "a"}, _page("a", [42]), tags=["book:42"])
        edition = 2
        if where == "here":
            await reader.invalidate_tag("book:42")
        else:
            await other.invalidate_tag("book:42")
            # The backplane brings it: the reader's listener reads past its entry.
            admin = redis.Redis.from_url(redis_url)
            stream = config.redis.prefix + config.backplane.stream
            entry = (await admin.xrevrange(stream, count=1))[0][0]
            await admin.aclose()

            def _id(raw: bytes) -> tuple[int, int]:
                ms, seq = raw.split(b"-")
                return int(ms), int(seq)

            def delivered() -> bool:
                last = reader._backplane.last_id if reader._backplane else None
                return last is not None and _id(last) >= _id(entry)

            assert await eventually(delivered, timeout=10)
        for _ in range(2):  # the second read: from L1, refilled with the new edition
            pages = await reader.get_or_load_many(
                "category", [{"slug": "a"}], load_many, tags=_tags_of
            )
            assert pages[0]["edition"] == 2


async def test_after_invalidate_tag_the_new_version_is_fetched_once_not_per_read(
    redis_server: RedisServer, prefix: str
) -> None:
    """An instance forgets an invalidated tag and fetches its new version on the next
    read; it must then remember it (a fetch that began after the invalidation is
    current), not fetch it again on every read. (Commands are counted on a Redis of the
    test's own: other tests write to the shared one meanwhile.)"""
    url = redis_server.url
    config = make_config(url, prefix, {"category": {**NAMESPACES["category"], "l1": False}})
    admin = redis.Redis.from_url(url)
    async with LayeredCache.from_config(config) as cache:
        await cache.set("category", {"slug": "a"}, _page("a", [42]), tags=["book:42"])
        await cache.invalidate_tag("book:42")
        await cache.set("category", {"slug": "a"}, _page("a", [42], 2), tags=["book:42"])
        await cache.get("category", {"slug": "a"})  # learns the version
        await admin.config_resetstat()
        for _ in range(5):
            assert (await cache.get("category", {"slug": "a"}))["edition"] == 2
        stats = await admin.info("commandstats")
    await admin.aclose()
    # A version fetch is SET NX + GET of the tag's key; the reads are 5 GETs.
    assert "cmdstat_set" not in stats, f"tag version fetched again: {stats}"


async def test_a_fresh_instance_learns_tag_versions_without_reloading(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    loader = CountingLoader(_page("scifi", [42]))
    async with LayeredCache.from_config(config) as first:
        await first.get_or_load("category", {"slug": "scifi"}, loader, tags=_tags_of)
    async with LayeredCache.from_config(config) as second:  # knows no version yet
        await second.get_or_load("category", {"slug": "scifi"}, loader, tags=_tags_of)
    assert loader.calls == 1


async def test_a_lost_tag_version_kills_its_entries_instead_of_reviving_them(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, NAMESPACES)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as writer:
        await writer.set("category", {"slug": "a"}, _page("a", [42]), tags=["book:42"])
    await admin.delete(tag_version_name(prefix, "book:42"))  # evicted, or deleted by hand
    async with LayeredCache.from_config(config) as reader:
        assert await reader.get("category", {"slug": "a"}) is None
    await admin.aclose()


async def _tag_version_keys(admin: redis.Redis, prefix: str) -> int:
    return len([name async for name in admin.scan_iter(tag_version_name(prefix, "*"), count=5_000)])


_TWENTY_THOUSAND = {f"book:{i}": "v" for i in range(20_000)}  # each one well-formed


@pytest.mark.parametrize(
    "tags",
    [{"bad tag": "v"}, {"": "v"}, {"é": "v"}, {"x" * 300: "v"}, _TWENTY_THOUSAND],
    ids=["space", "empty", "non-ascii", "too-long", "20000-tags"],
)
async def test_an_envelope_planted_with_tags_no_caller_could_give_is_a_miss_and_repaired(
    redis_url: str, prefix: str, tags: dict[str, str]
) -> None:
    """Anyone who can write Redis can plant a tagged envelope. Its tags used to be taken
    as they came: every read of the key raised (the version lookup refused the tag), and
    get_or_load raised before loading, so nothing could ever repair the key. And a
    reader fetches every tag of an entry it hasn't seen, creating the version key of a
    tag that has none: 20,000 well-formed made-up tags had every instance that read the
    entry write 20,000 keys, each living a day. An entry carries at most ``MAX_TAGS``,
    so one with more was planted: no tag of it is fetched."""

    async def load_many(missing: list[Mapping[str, object]]) -> list[str]:
        return ["fresh"] * len(missing)

    admin = redis.Redis.from_url(redis_url)
    planted = msgspec.msgpack.encode([1, "poison", 1.0, 9e18, 0.0, tags])
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        for slug in "abcd":
            await admin.set(cache.key("category", {"slug": slug}), planted)
        assert await cache.get("category", {"slug": "a"}) is None
        assert await cache.get_many("category", [{"slug": "b"}]) == [None]
        loader = CountingLoader("fresh")
        assert await cache.get_or_load("category", {"slug": "c"}, loader, tags=["t"]) == "fresh"
        fields = [{"slug": "d"}]
        assert await cache.get_or_load_many("category", fields, load_many, tags=["t"]) == [
            "fresh"
        ]
        assert loader.calls == 1
        assert await _tag_version_keys(admin, prefix) == 1  # "t", the loads' own tag
        cache.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        assert await cache.get("category", {"slug": "c"}) == "fresh"  # repaired in L2
    await admin.aclose()


async def test_a_planted_envelope_in_a_batch_is_a_miss_beside_live_tagged_entries(
    redis_url: str, prefix: str
) -> None:
    """Tag names in an envelope are checked only when this instance doesn't hold their
    versions (``_codec.Envelope``): one planted entry in a batch of live ones, with
    tags known and unknown, is the only miss."""
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as writer:
        await writer.set("category", {"slug": "a"}, "page a", tags=["book:1", "book:2"])
        await writer.set("category", {"slug": "b"}, "page b", tags=["book:2"])
        planted = msgspec.msgpack.encode([1, "poison", 1.0, 9e18, 0.0, {"book:2": "x", "a b": "v"}])
        await admin.set(writer.key("category", {"slug": "c"}), planted)
        fields = [{"slug": s} for s in "abc"]
        assert await writer.get_many("category", fields) == ["page a", "page b", None]
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as fresh:
        # This instance knows no tag yet: every one is checked, the good ones fetched.
        assert await fresh.get_many("category", fields) == ["page a", "page b", None]
        assert await fresh.get("category", {"slug": "c"}) is None
    await admin.aclose()


async def test_a_batch_of_planted_entries_of_1000_tags_each_makes_no_tag_key(
    redis_url: str, prefix: str
) -> None:
    """``MAX_TAGS`` bounds one entry, not a read: one get_many of 100 planted entries,
    each with 1,000 well-formed made-up tags, made 100,000 version keys living a day,
    and the fetch of so many made the instance forget the versions it held (found by an
    adversarial review). Readers now create no version key: a tag without one kills
    the entry (a new random token could never match it), and only writers make them."""
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        await cache.set("category", {"slug": "live"}, "page", tags=["book:1"])
        for n in range(20):
            tags = {f"made-up:{n}:{i}": "v" for i in range(_tags.MAX_TAGS)}
            planted = msgspec.msgpack.encode([1, "poison", 1.0, 9e18, 0.0, tags])
            await admin.set(cache.key("category", {"slug": f"p{n}"}), planted)
        fields = [{"slug": "live"}, *({"slug": f"p{n}"} for n in range(20))]
        cache.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        assert await cache.get_many("category", fields) == ["page", *[None] * 20]
        assert await cache.get("category", {"slug": "p0"}) is None
        assert await _tag_version_keys(admin, prefix) == 1  # book:1, the writer's
        assert cache._rt.versions.known({"book:1": "x"}) is False  # its version still held
    await admin.aclose()


async def test_a_reader_that_finds_a_tags_version_key_gone_does_not_make_one(
    redis_url: str, prefix: str
) -> None:
    """The entry is dead (as when a reader made a new random token for it), and the
    version key is made by the next writer, the load that replaces the entry."""
    admin = redis.Redis.from_url(redis_url)
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as writer:
        await writer.set("category", {"slug": "a"}, "old page", tags=["book:42"])
    await admin.delete(tag_version_name(prefix, "book:42"))  # expired, or evicted
    async with LayeredCache.from_config(config) as reader:
        assert await reader.get("category", {"slug": "a"}) is None
        assert await reader.get_many("category", [{"slug": "a"}]) == [None]
        assert await admin.exists(tag_version_name(prefix, "book:42")) == 0
        loader = CountingLoader("new page")
        assert await reader.get_or_load("category", {"slug": "a"}, loader, tags=["book:42"]) == (
            "new page"
        )
        assert await admin.exists(tag_version_name(prefix, "book:42")) == 1
        reader.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        assert await reader.get("category", {"slug": "a"}) == "new page"
    await admin.aclose()


def test_an_envelope_with_more_than_max_tags_is_refused_by_the_decoder() -> None:
    """From the tags map's header, before its entries are read: an envelope planted with
    200,000 tags took ~26 ms of CPU to decode on every read before its count was looked
    at; the read path takes the ``CodecError`` for a miss. At the limit it decodes."""
    codec: Codec[Any] = Codec()
    at_limit = {f"book:{i}": "v" for i in range(MAX_TAGS)}
    assert codec.decode(codec.encode("page", 1.0, 2.0, 0.0, at_limit)).tags == at_limit
    planted = msgspec.msgpack.encode([1, "p", 1.0, 9e18, 0.0, {f"b:{i}": "v" for i in range(200_000)}])
    with pytest.raises(CodecError, match="length <= 1000"):
        codec.decode(planted)
    with pytest.raises(CodecError):
        decode_meta(planted)


async def _evals(admin: redis.Redis) -> int:
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_eval", {}).get("calls", 0))


async def test_reads_of_an_entry_whose_tag_has_no_key_ask_redis_once_not_every_time(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers make no version key, so nothing remembered a tag found without one, and
    every read of its entries asked Redis again: 100 gets, ~124 EVALs; a planted entry
    of 1,000 made-up tags, 1,000 EVALs per get (found by an adversarial review). Such a
    tag is now dead here for ``_ABSENT_FOR``; a writer's key (a load, here) or its
    invalidation ends that at once. A Redis of its own: EVALs are counted."""
    monkeypatch.setattr(_tags, "_ABSENT_FOR", 0.5)
    redis_url = redis_server.url
    admin = redis.Redis.from_url(redis_url)
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as writer:
        await writer.set("category", {"slug": "a"}, "old page", tags=["book:42"])
    await admin.delete(tag_version_name(prefix, "book:42"))  # expired, or evicted
    planted = msgspec.msgpack.encode(
        [1, "poison", 1.0, 9e18, 0.0, {f"made-up:{i}": "v" for i in range(_tags.MAX_TAGS)}]
    )
    async with LayeredCache.from_config(config) as reader:
        await admin.set(reader.key("category", {"slug": "p"}), planted)
        before = await _evals(admin)
        for _ in range(100):
            assert await reader.get("category", {"slug": "a"}) is None
            assert await reader.get("category", {"slug": "p"}) is None
        assert await _evals(admin) - before == 1 + _tags.MAX_TAGS  # one lookup each
        await asyncio.sleep(0.6)  # the absence is looked up again once it has passed
        assert await reader.get("category", {"slug": "a"}) is None
        assert await _evals(admin) - before == 2 + _tags.MAX_TAGS
        loader = CountingLoader("new page")  # a writer here: its fetch makes the key
        assert await reader.get_or_load("category", {"slug": "a"}, loader, tags=["book:42"]) == (
            "new page"
        )
        reader.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        assert await reader.get("category", {"slug": "a"}) == "new page"
    await admin.aclose()


async def test_an_entry_may_carry_max_tags_and_one_more_is_a_clear_error(
    redis_url: str, prefix: str
) -> None:
    """Writers refuse what readers would take for planted: set()'s tags and a load's,
    before anything is written; at the limit the entry is served, and
    dies with any one of its tags."""
    most = [f"book:{i}" for i in range(_tags.MAX_TAGS)]
    too_many = [*most, "book:extra"]
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        with pytest.raises(ValueError, match="at most 1,000 tags, got 1,001"):
            await cache.set("category", {"slug": "a"}, "page", tags=too_many)
        with pytest.raises(ValueError, match="at most 1,000 tags"):
            await cache.get_or_load("category", {"slug": "a"}, CountingLoader("page"), tags=too_many)
        assert await admin.exists(cache.key("category", {"slug": "a"})) == 0
        await cache.set("category", {"slug": "a"}, "page", tags=[*most, *most])  # duplicates
        cache.namespace("category").policy.l1.clear()  # type: ignore[union-attr]
        assert await cache.get("category", {"slug": "a"}) == "page"
        await cache.invalidate_tag("book:999")
        assert await cache.get("category", {"slug": "a"}) is None
    await admin.aclose()


@pytest.mark.parametrize("tag", ["book 42", "book{42}", "", "x" * 300])
async def test_a_bad_tag_is_a_clear_error(redis_url: str, prefix: str, tag: str) -> None:
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        with pytest.raises(ValueError, match="tag"):
            await cache.set("category", {"slug": "a"}, "page", tags=[tag])
        with pytest.raises(ValueError, match="tag"):
            await cache.invalidate_tag(tag)


async def test_a_string_given_as_tags_is_refused_by_set_as_by_the_reads(
    redis_url: str, prefix: str
) -> None:
    # "book:42" iterated is b, o, o, k, :, 4, 2: seven valid tags, none of them the one
    # meant, so the entry would have outlived invalidate_tag("book:42").
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        with pytest.raises(TypeError, match="list of strings"):
            await cache.set("category", {"slug": "a"}, "page", tags="book:42")
        with pytest.raises(TypeError, match="list of strings"):
            await cache.get_or_load("category", {"slug": "a"}, CountingLoader(), tags="book:42")
        assert await cache.get("category", {"slug": "a"}) is None


async def _tags_looked_up(page: Any) -> list[str]:
    return ["book:42"]


# tags= of a wrong kind -> (what the error says, whether it is refused before the load).
_WRONG_TAGS: dict[str, tuple[Any, str, bool]] = {
    # bytes from a header or a Redis reply: was a tag per byte ("not int: 98")
    "bytes": (b"book:42", "tags must be a list of strings, not bytes b'book:42'", True),
    "bytearray": (bytearray(b"book:42"), "not bytearray", True),
    "not_iterable": (42, "tags must be a list of strings or a function of the value, got int", True),
    # a forgotten return: was "'NoneType' object is not iterable"
    "function_returning_none": (
        lambda page: None, "the tags function must return a list of strings, got None", False
    ),
    # was "'coroutine' object is not iterable", and a coroutine never awaited
    "async_function": (_tags_looked_up, "tags must be a plain function of the value, not the async", True),
    "function_returning_a_coroutine": (
        lambda page: _tags_looked_up(page), "the tags function must return a list of strings, got coroutine", False
    ),
}


@pytest.mark.parametrize("call", ["get_or_load", "get_or_load_many", "set"])
@pytest.mark.parametrize("case", list(_WRONG_TAGS))
async def test_a_tags_argument_of_the_wrong_kind_is_a_clear_error(
    redis_url: str, prefix: str, case: str, call: str
) -> None:
    tags, message, up_front = _WRONG_TAGS[case]
    if call == "set" and callable(tags):
        pytest.skip("set() takes a list")
    loader = CountingLoader(_page("a", [42]))

    async def load_many(fields_list: list[Mapping[str, object]]) -> list[Any]:
        return [await loader() for _ in fields_list]

    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        with pytest.raises(TypeError) as caught:
            if call == "set":
                await cache.set("category", {"slug": "a"}, _page("a", [42]), tags=tags)
            elif call == "get_or_load":
                await cache.get_or_load("category", {"slug": "a"}, loader, tags=tags)
            else:
                await cache.get_or_load_many("category", [{"slug": "a"}], load_many, tags=tags)
        assert message in str(caught.value)
        assert loader.calls == (0 if up_front else 1)
        assert await cache.get("category", {"slug": "a"}) is None  # nothing written


async def test_a_generator_given_as_tags_is_refused_not_read_once_and_lost(
    redis_url: str, prefix: str
) -> None:
    """``tags=(f"book:{b}" for b in ids)``: the check read it, the write found it empty,
    and the entry, untagged, outlived invalidate_tag."""
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        with pytest.raises(TypeError, match="one-shot iterator"):
            await cache.get_or_load(
                "category", {"slug": "a"}, CountingLoader(), tags=(t for t in ["book:42"])
            )
        with pytest.raises(TypeError, match="one-shot iterator"):
            await cache.set("category", {"slug": "a"}, "page", tags=iter(["book:42"]))
        with pytest.raises(TypeError, match="one-shot iterator"):
            cache.cached("category", tags=(t for t in ["book:42"]))(CountingLoader())
        assert await cache.get("category", {"slug": "a"}) is None


async def test_entries_of_a_tagged_namespace_without_l2_die_with_their_tag(
    redis_url: str, prefix: str
) -> None:
    """``l2 = false``: the entries live in each instance's L1 only, and a read-through
    fill was not indexed under its tags, so invalidate_tag left it for its L1 TTL."""

    async def load_many(missing: list[Mapping[str, object]]) -> list[str]:
        return ["page-b" for _ in missing]

    namespaces = {"category": {"key": "category:{slug}", "tags": True, "l2": False}}
    async with LayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:
        await cache.get_or_load("category", {"slug": "a"}, CountingLoader("page-a"), tags=["t"])
        await cache.get_or_load_many("category", [{"slug": "b"}], load_many, tags=["t"])
        assert await cache.get("category", {"slug": "a"}) == "page-a"  # from L1
        await cache.invalidate_tag("t")
        assert await cache.get("category", {"slug": "a"}) is None
        assert await cache.get("category", {"slug": "b"}) is None


async def test_a_load_of_a_namespace_without_l2_that_began_before_invalidate_tag_is_not_kept(
    redis_url: str, prefix: str
) -> None:
    namespaces = {"category": {"key": "category:{slug}", "tags": True, "l2": False}}
    release = asyncio.Event()

    async def slow_page() -> str:
        await release.wait()
        return "page read before the change"

    async with LayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:
        read = asyncio.create_task(cache.get_or_load("category", {"slug": "a"}, slow_page, tags=["t"]))
        await asyncio.sleep(0.05)  # the load is running
        await cache.invalidate_tag("t")
        release.set()
        assert await read == "page read before the change"  # served to its caller once
        assert await cache.get("category", {"slug": "a"}) is None  # but not kept


async def test_tags_on_a_namespace_without_tags_true_are_refused(
    redis_url: str, prefix: str
) -> None:
    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        with pytest.raises(ValueError, match="namespace 'book' takes no tags"):
            await cache.set("book", {"id": 1}, "b", tags=["book:1"])
        with pytest.raises(ValueError, match="tags = true"):
            await cache.get_or_load("book", {"id": 1}, CountingLoader(), tags=["book:1"])


@pytest.mark.parametrize("invalidator", ["new_pod", "old_pod"])
async def test_an_instance_without_tags_true_drops_tagged_entries_it_holds_when_their_tag_dies(
    redis_url: str, prefix: str, invalidator: str
) -> None:
    """A rolling deploy turns tags on: the old pods run a config without ``tags = true``
    and read the tagged entries the new pods write (into L1, indexed under their tags).
    The tag's invalidation, theirs or another's through the backplane, drops them there
    too, as a key invalidation would."""
    category: dict[str, Any] = {"key": "category:{slug}", "l1": {"ttl": "60s"}}
    new = make_config(redis_url, prefix, {"category": {**category, "tags": True}})
    old = make_config(redis_url, prefix, {"category": category})
    page = _page("scifi", [42])
    async with LayeredCache.from_config(new) as new_pod, LayeredCache.from_config(old) as old_pod:
        await _connected(new_pod, old_pod)
        await new_pod.set("category", {"slug": "scifi"}, page, tags=["book:42"])
        assert await old_pod.get("category", {"slug": "scifi"}) == page  # now in its L1
        await (new_pod if invalidator == "new_pod" else old_pod).invalidate_tag("book:42")

        async def gone(pod: LayeredCache) -> bool:
            return await pod.get("category", {"slug": "scifi"}) is None

        assert await eventually(lambda: gone(old_pod), timeout=2.0), "the old pod serves it"
        assert await eventually(lambda: gone(new_pod), timeout=2.0)


@pytest.mark.kafka
async def test_a_price_change_event_kills_the_category_pages_showing_the_book(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    from layered_cache.daemon import Daemon
    from tests.servers import create_topic
    from tests.test_daemon import daemon_config, price_changed, producer, running

    base = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, namespaces=NAMESPACES)
    routes = [
        {
            "type": "BookPriceChanged",
            "invalidate": [
                {"namespace": "book", "key": {"id": "book_id"}},
                {"tag": "book:{book_id}"},
            ],
        }
    ]
    # The test daemon's Kafka settings, with a route that also names a tag.
    config = msgspec.structs.replace(base, events=msgspec.convert(routes, list[EventRoute]))
    await create_topic(kafka_bootstrap, unique_topic, 1)
    async with (
        LayeredCache.from_config(config) as a,
        LayeredCache.from_config(config) as b,
        running(Daemon(config)) as daemon,
        producer(kafka_bootstrap) as p,
    ):
        await _connected(a, b)
        scifi = CountingLoader(_page("scifi", [42, 7]))
        for cache in (a, b):
            await cache.get_or_load("category", {"slug": "scifi"}, scifi, tags=_tags_of)
        await p.send_and_wait(unique_topic, price_changed(42))
        for _ in range(200):
            if all([await c.get("category", {"slug": "scifi"}) is None for c in (a, b)]):
                break
            await asyncio.sleep(0.02)
        assert [await c.get("category", {"slug": "scifi"}) for c in (a, b)] == [None, None]
        assert daemon.stats.tags_invalidated == 1


def test_a_route_target_is_a_key_or_a_tag_never_both() -> None:
    from layered_cache import ConfigError, parse_config

    both = {"namespace": "category", "key": {"slug": "s"}, "tag": "book:{book_id}"}
    bad_tag = {"tag": "book {book_id}"}
    for target in (both, bad_tag):
        raw = {"namespaces": NAMESPACES, "events": [{"type": "E", "invalidate": [target]}]}
        with pytest.raises(ConfigError, match=r"events\[0\]\.invalidate\[0\]"):
            parse_config(raw, env={})


def test_a_route_whose_tags_would_all_be_too_long_is_refused_at_load() -> None:
    """It loaded, and then every such event was a poison event (a tag is at most 256
    characters)."""
    from layered_cache import ConfigError, parse_config

    route = {"tag": "t" * 300 + ":{book_id}"}
    raw = {"namespaces": NAMESPACES, "events": [{"type": "E", "invalidate": [route]}]}
    with pytest.raises(ConfigError, match=r"invalidate\[0\]\.tag: builds tags of at least 302"):
        parse_config(raw, env={})
    route["tag"] = "t" * 250 + ":{book_id}"  # fits
    assert parse_config(raw, env={}).events[0].invalidate[0].tag == route["tag"]


async def test_an_instance_that_waited_for_another_ones_tagged_fill_keeps_it_in_l1(
    redis_url: str, prefix: str
) -> None:
    from layered_cache._l1 import MISSING

    config = make_config(redis_url, prefix, NAMESPACES)
    gate = asyncio.Event()

    async def slow() -> dict[str, Any]:
        await gate.wait()
        return _page("scifi", [42])

    async with (
        LayeredCache.from_config(config) as filler,
        LayeredCache.from_config(config) as waiter,
    ):
        filling = asyncio.ensure_future(
            filler.get_or_load("category", {"slug": "scifi"}, slow, tags=_tags_of)
        )
        await asyncio.sleep(0.1)  # the filler holds the lease
        waiting = asyncio.ensure_future(
            waiter.get_or_load("category", {"slug": "scifi"}, CountingLoader("x"), tags=_tags_of)
        )
        await asyncio.sleep(0.1)
        gate.set()
        assert (await waiting) == _page("scifi", [42]) == await filling
        l1 = waiter.namespace("category").policy.l1
        assert l1 is not None and l1.get(f"{prefix}category:scifi") is not MISSING


# -- loads racing invalidate_tag (found by review, 2026-12-04) ------------------------------


def _pause_invalidation(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold every ``invalidate_tags`` just before or just after its revocation of the
    loads in flight (``take_loading``): between that and the new tokens' SETs, in one
    order or the other."""
    paused, go_on = asyncio.Event(), asyncio.Event()
    take = _tags.take_loading

    async def held_take(store: Any, prefix: str) -> None:
        if when == "before_revoking":
            paused.set()
            await go_on.wait()
        await take(store, prefix)
        if when == "after_revoking":
            paused.set()
            await go_on.wait()

    monkeypatch.setattr(_tags, "take_loading", held_take)
    return paused, go_on


@pytest.mark.parametrize("when", ["before_revoking", "after_revoking"])
@pytest.mark.parametrize("via", ["cache", "daemon"])
async def test_a_load_that_began_before_invalidate_tag_never_lands_whatever_token_it_fetches(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, via: str, when: str
) -> None:
    """The new token was written before the loads in flight were revoked: a load that
    began before the change could fill in between, under its still valid lease and with
    the new token (fetched then: a tag its instance had never seen, or no longer
    trusted), and the old page was alive for every instance. The revocation comes
    first now."""
    config = make_config(redis_url, prefix, NAMESPACES)
    started, release = asyncio.Event(), asyncio.Event()

    async def old_page() -> dict[str, Any]:
        started.set()
        await release.wait()
        return _page("scifi", [42], edition=1)

    deleter = Deleter(config)
    try:
        async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
            await _connected(a, b)
            loading = asyncio.create_task(
                a.get_or_load("category", {"slug": "scifi"}, old_page, tags=_tags_of)
            )
            await asyncio.wait_for(started.wait(), 5)
            paused, go_on = _pause_invalidation(monkeypatch, when)
            if via == "cache":
                invalidating = asyncio.create_task(b.invalidate_tag("book:42"))
            else:
                invalidating = asyncio.create_task(
                    deleter.delete([], DaemonStats(), tags=["book:42"])
                )
            await asyncio.wait_for(paused.wait(), 5)
            release.set()  # the old page's fill lands now
            await loading
            go_on.set()
            await invalidating
            async with LayeredCache.from_config(config) as fresh:
                new = CountingLoader(_page("scifi", [42], edition=2))
                for cache in (fresh, b, a):
                    got = await cache.get_or_load("category", {"slug": "scifi"}, new, tags=_tags_of)
                    assert got["edition"] == 2
    finally:
        await deleter.close()


async def test_a_slow_load_leaving_does_not_unregister_a_newer_load_of_the_same_key(
    redis_url: str, prefix: str
) -> None:
    """The loading set held lease names: X's load outlived its lease, Y took the lease
    and registered the same name (a no-op), X's leaving removed it, and invalidate_tag
    then did not revoke Y, whose old page landed. Members carry the load's token now."""
    namespaces = {
        "category": {
            "key": "category:{slug}",
            "tags": True,
            "stampede": {"lease_ttl": "300ms", "max_wait": "100ms"},
        }
    }
    config = make_config(redis_url, prefix, namespaces)
    x_started, x_go, y_started, y_go = (asyncio.Event() for _ in range(4))

    def old_page(started: asyncio.Event, go: asyncio.Event) -> Any:
        async def load() -> dict[str, Any]:
            started.set()
            await go.wait()
            return _page("scifi", [42], edition=1)

        return load

    async with (
        LayeredCache.from_config(config) as x,
        LayeredCache.from_config(config) as y,
        LayeredCache.from_config(config) as z,
    ):
        await _connected(x, y, z)
        fields = {"slug": "scifi"}
        x_load = asyncio.create_task(
            x.get_or_load("category", fields, old_page(x_started, x_go), tags=_tags_of)
        )
        await asyncio.wait_for(x_started.wait(), 5)
        await asyncio.sleep(0.4)  # X's lease expires
        y_load = asyncio.create_task(
            y.get_or_load("category", fields, old_page(y_started, y_go), tags=_tags_of)
        )
        await asyncio.wait_for(y_started.wait(), 5)
        x_go.set()
        await x_load  # its fill is refused; it leaves the loading set
        await asyncio.sleep(0.2)
        await z.invalidate_tag("book:42")
        y_go.set()
        await y_load
        new = CountingLoader(_page("scifi", [42], edition=2))
        got = await z.get_or_load("category", fields, new, tags=_tags_of)
        assert got["edition"] == 2


@pytest.mark.parametrize(
    "tags", ["book:1", ["bad tag"], [1], [f"book:{i}" for i in range(MAX_TAGS + 1)]],
    ids=["a-string", "a-bad-name", "not-a-string", "too-many"],
)
async def test_a_list_of_tags_no_entry_may_carry_is_refused_before_the_load_and_on_a_hit(
    redis_url: str, prefix: str, tags: Any
) -> None:
    """set() refused them up front; get_or_load and get_or_load_many ran the loader
    first and raised after it, and on a hit took them without a word."""
    loads: list[int] = []

    async def load() -> str:
        loads.append(1)
        return "page"

    async def load_many(missing: list[Mapping[str, object]]) -> list[str]:
        loads.append(len(missing))
        return ["page"] * len(missing)

    async with LayeredCache.from_config(make_config(redis_url, prefix, NAMESPACES)) as cache:
        page = {"slug": "scifi"}
        with pytest.raises((TypeError, ValueError)):
            await cache.get_or_load("category", page, load, tags=tags)
        with pytest.raises((TypeError, ValueError)):
            await cache.get_or_load_many("category", [page], load_many, tags=tags)
        assert loads == []
        await cache.set("category", page, "page", tags=["book:1"])
        with pytest.raises((TypeError, ValueError)):  # an L1 hit
            await cache.get_or_load("category", page, load, tags=tags)


async def test_a_reader_without_tags_never_refreshes_a_tagged_entry_into_an_untagged_one(
    redis_url: str, prefix: str
) -> None:
    """Promise (README, "Tags die everywhere"): after invalidate_tag "no instance serves
    an entry carrying the tag, from L2, a replica or its L1"; "Early refresh": "readers
    keep getting the current value".

    Scenario: the category page is loaded with tags=["book:1"]. Another caller reads
    the same key through get_or_load without tags= (e.g. a @cache.cached function,
    which has no way to pass tags) and only gets an L2 hit. That *read* starts an XFetch
    refresh, and the refresh rewrites the entry with the reader's (absent) tags.
    Observed: after invalidate_tag("book:1") the page is still served, from L2.
    Expected: the page dies with the tag. Such a reader can't compute the new value's
    tags, so it leaves the refresh to tagged readers (found by a review, 2026-12-05).
    Cause: ``_refresh.Refresher._refresh`` builds its Read with ``request.tags_of`` of
    whichever read triggered it, not from the envelope it refreshes."""
    namespaces = {
        "category": {
            "key": "category:{slug}",
            "tags": True,
            "l1": False,
            "l2": {"ttl": "2s", "jitter": 0},
            "stampede": {"early_refresh_beta": 100.0},
        }
    }
    config = make_config(redis_url, prefix, namespaces)
    edition = {"n": 0}

    async def load_page() -> dict[str, Any]:
        edition["n"] += 1
        await asyncio.sleep(0.02)  # delta > 0: XFetch is eager with beta = 100
        return {"books": [1], "edition": edition["n"]}

    async with LayeredCache.from_config(config, rand=lambda: 0.99) as cache:
        first = await cache.get_or_load(
            "category", {"slug": "scifi"}, load_page, tags=lambda p: [f"book:{b}" for b in p["books"]]
        )
        assert first["edition"] == 1
        # A plain reader: an L2 hit, which starts a refresh in the background.
        assert (await cache.get_or_load("category", {"slug": "scifi"}, load_page))["edition"] == 1
        await asyncio.sleep(0.3)  # a refresh it started would have landed by now
        await cache.invalidate_tag("book:1")
        after = await cache.get("category", {"slug": "scifi"})
        assert after is None, f"entry tagged book:1 survived invalidate_tag: {after}"


async def test_a_cached_function_gives_its_tags_and_its_entries_die_with_them(
    redis_url: str, prefix: str
) -> None:
    """``@cache.cached`` took no tags: in a tagged namespace its entries outlived every
    ``invalidate_tag``, and a tagged call joining its load got one of those too."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as cache:
        editions = iter(range(1, 10))

        @cache.cached("category", tags=_tags_of)
        async def category(slug: str) -> dict[str, Any]:
            return _page(slug, [42], next(editions))

        assert (await category("scifi"))["edition"] == 1
        assert (await category("scifi"))["edition"] == 1  # cached
        await cache.invalidate_tag("book:42")
        assert (await category("scifi"))["edition"] == 2
        with pytest.raises(ValueError, match="takes no tags"):  # when it decorates
            cache.cached("book", tags=["book:1"])(category)


def test_a_sync_cached_function_gives_its_tags_too(redis_url: str, prefix: str) -> None:
    from layered_cache.sync import SyncLayeredCache

    config = make_config(redis_url, prefix, NAMESPACES)
    with SyncLayeredCache.from_config(config) as cache:
        editions = iter(range(1, 10))

        @cache.cached("category", tags=_tags_of)
        def category(slug: str) -> dict[str, Any]:
            return _page(slug, [42], next(editions))

        assert category("scifi")["edition"] == 1
        cache.invalidate_tag("book:42")
        assert category("scifi")["edition"] == 2
        with pytest.raises(ValueError, match="takes no tags"):
            cache.cached("book", tags=["book:1"])(category)


@pytest.mark.parametrize("foreign", [b"\xff\xfe\x00", b"set-by-another-client", b"v1"])
async def test_a_tag_version_another_client_wrote_is_a_dead_tag_the_next_writer_repairs(
    redis_url: str, prefix: str, foreign: bytes
) -> None:
    """Bytes that aren't UTF-8 at a tag's version key raised UnicodeDecodeError from
    every read of an entry carrying the tag, and from every tagged write (its SET NX
    kept them): the tag unusable on every instance for the key's day. A version no
    writer of ours made is now no version: its entries are dead, and a writer replaces
    it, as a fill replaces a foreign value at a cache key."""
    config = make_config(redis_url, prefix, NAMESPACES)
    async with LayeredCache.from_config(config) as cache:
        await cache.set("category", {"slug": "scifi"}, _page("scifi", [42]), tags=["book:42"])
    admin = redis.Redis.from_url(redis_url)
    await admin.set(tag_version_name(prefix, "book:42"), foreign)
    await admin.aclose()
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get("category", {"slug": "scifi"}) is None
        fresh = CountingLoader(_page("scifi", [42], edition=2))
        page = await cache.get_or_load("category", {"slug": "scifi"}, fresh, tags=_tags_of)
        assert page["edition"] == 2
        assert await cache.get("category", {"slug": "scifi"}) == page  # repaired
        await cache.invalidate_tag("book:42")
        assert await cache.get("category", {"slug": "scifi"}) is None
