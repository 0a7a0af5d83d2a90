"""A namespace is an object (a region, in dogpile.cache's terms) that owns its policy
and read path; the cache is its registry. These scenarios pin the public surface of
that split: the object answers like the cache does, a namespace has one value type,
and the constructor takes injected parts."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from layered_cache import LayeredCache
from layered_cache._wiring import build_parts
from tests.helpers import CountingLoader, make_config


@dataclasses.dataclass
class Book:
    id: int
    title: str


@dataclasses.dataclass
class Author:
    id: int
    name: str


async def test_the_namespace_object_answers_like_the_cache(redis_url: str, prefix: str) -> None:
    loader = CountingLoader({"id": 1, "title": "Emma"})
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        books = cache.namespace("book")
        assert await books.get_or_load({"id": 1}, loader) == {"id": 1, "title": "Emma"}
        assert await cache.get_or_load("book", {"id": 1}, loader) == {"id": 1, "title": "Emma"}
        assert await books.get({"id": 1}) == {"id": 1, "title": "Emma"}
        assert books.key({"id": 1}) == cache.key("book", {"id": 1}) == f"{prefix}book:1"
        assert loader.calls == 1
        assert books.stats() == cache.stats()["book"]


async def test_an_unknown_namespace_is_a_key_error_naming_the_configured_ones(
    redis_url: str, prefix: str
) -> None:
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        with pytest.raises(KeyError, match=r"unknown namespace 'bok' \(configured: \['book'\]\)"):
            await cache.get_or_load("bok", {"id": 1}, CountingLoader())


async def test_a_namespace_decodes_into_one_type_and_a_second_declaration_is_an_error(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config, value_types={"book": Book}) as cache:

        @cache.cached("book")
        async def same(id: int) -> Book:  # the same type again: fine
            return Book(id, "Emma")

        assert await same(1) == Book(1, "Emma")
        with pytest.raises(TypeError, match="namespace 'book' already decodes into"):

            @cache.cached("book")
            async def other(id: int) -> Author:
                return Author(id, "Austen")


async def test_one_type_spelled_two_ways_is_one_declaration(redis_url: str, prefix: str) -> None:
    """Found by a review (2026-12-06). README: "a second, *different* declaration raises
    TypeError". ``list[Book]`` and ``typing.List[Book]`` are one type to msgspec (a code
    base half through pyupgrade has both): it raised. A different type still does."""
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config, value_types={"book": list[Book]}) as cache:

        @cache.cached("book")
        async def shelf(id: int) -> typing.List[Book]:  # noqa: UP006 (the old spelling)
            return [Book(id, "Emma")]

        assert await shelf(1) == [Book(1, "Emma")]
        with pytest.raises(TypeError, match="already decodes into"):

            @cache.cached("book")
            async def other(id: int) -> typing.List[Author]:  # noqa: UP006
                return [Author(id, "Austen")]


async def test_value_types_for_an_unknown_namespace_fail_at_construction(
    redis_url: str, prefix: str
) -> None:
    with pytest.raises(KeyError, match="unknown namespace 'author'"):
        LayeredCache.from_config(make_config(redis_url, prefix), value_types={"author": Author})


async def test_the_constructor_takes_injected_parts(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix)
    parts = build_parts(config)
    async with LayeredCache(config, parts) as cache:
        await cache.set("book", {"id": 7}, {"title": "Persuasion"})
        assert await parts.client.exists(f"{prefix}book:7") == 1
        assert cache.instance_id == parts.instance_id


async def test_async_api_misuse_is_a_clear_error_where_the_mistake_is(
    redis_url: str, prefix: str
) -> None:
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        with pytest.raises(TypeError, match=r"not an async function.*SyncLayeredCache"):

            @cache.cached("book")
            def plain(id: int) -> dict[str, int]:  # a plain def under the async decorator
                return {"id": id}

        with pytest.raises(TypeError, match="loader returned a dict, not an awaitable"):
            await cache.get_or_load("book", {"id": 1}, lambda: {"id": 1})  # type: ignore[arg-type, return-value]

        def sync_many(fields_list: list[object]) -> list[int]:
            return [1 for _ in fields_list]

        with pytest.raises(TypeError, match="returned a list, not an awaitable"):
            await cache.get_or_load_many("book", [{"id": 2}], sync_many)  # type: ignore[arg-type]
