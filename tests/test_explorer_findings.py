"""What the schedule explorer found in the tag paths (docs/explorer.md, "What the new
operations found"), each as one deterministic scenario against a real Redis. They fail
today and are marked ``xfail(strict=True)``: the fix (in ``layered_cache/``) makes them
pass, and then the marker must go."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import redis.asyncio.client as redis_client

from layered_cache import LayeredCache
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


class HeldReply:
    """Once armed, the next pipeline's reply (Redis has answered it) is held until
    ``release`` is set: the explorer's "slow reply" window."""

    def __init__(self) -> None:
        self.armed = False
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()


@pytest.fixture
def held_pipeline_reply() -> Iterator[HeldReply]:
    original = redis_client.Pipeline.execute
    held = HeldReply()

    async def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        if held.armed:
            held.armed = False
            held.arrived.set()
            await held.release.wait()
        return result

    redis_client.Pipeline.execute = execute  # type: ignore[method-assign]
    try:
        yield held
    finally:
        held.release.set()
        redis_client.Pipeline.execute = original  # type: ignore[method-assign]


@pytest.mark.xfail(
    strict=True,
    reason="explorer seeds 20261364, 20261424 (tags): TagVersions._fetch stores the version "
    "its pipeline read even when a newer one was learned (invalidate_tag, backplane) while "
    "the reply was in flight; the instance then takes dead entries for alive, indefinitely",
)
async def test_a_tag_version_fetched_before_an_invalidation_does_not_overwrite_the_newer_one(
    redis_url: str, prefix: str, held_pipeline_reply: HeldReply
) -> None:
    held = held_pipeline_reply
    config = make_config(redis_url, prefix, NAMESPACES)
    async with (
        LayeredCache.from_config(config) as writer,
        LayeredCache.from_config(config) as reader,
    ):
        await _connected(writer, reader)
        await writer.set("category", SCIFI, _page(1), tags=["book:42"])
        held.armed = True
        # The reader has never seen book:42: its get fetches the version (one pipeline),
        # whose reply is held after Redis answered it with the old version...
        reading = asyncio.ensure_future(reader.get("category", SCIFI))
        await asyncio.wait_for(held.arrived.wait(), 5)
        await writer.invalidate_tag("book:42")  # ...while the tag is invalidated
        versions = reader._rt.versions
        await _until(lambda: versions.known({"book:42": ""}) is False)  # reader learned it
        held.release.set()
        await reading  # began before the invalidation: either answer is allowed
        # Afterwards the old page is dead for the reader as for everyone else.
        assert await writer.get("category", SCIFI) is None
        assert await reader.get("category", SCIFI) is None


@pytest.mark.xfail(
    strict=True,
    reason="explorer seed 20261484 (tags): invalidate_tag detaches in-flight loads only of "
    "keys already in the L1 tag index, so a caller arriving after the invalidation joins "
    "a load that began before it and gets the superseded value",
)
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


@pytest.mark.xfail(
    strict=True,
    reason="explorer seed 20261319 (tags): when the tag versions can't be read after a "
    "load, the fill returns the loader's own object, not the value as L2 decodes it "
    "(fix 11: a call's type must not depend on the layer that answered)",
)
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
