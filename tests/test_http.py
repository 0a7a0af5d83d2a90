"""HTTP caching of the bookstore's responses (layered_cache.http, layered_cache.asgi):
Cache-Control from each namespace's policy, a strong ETag, and 304s answered from L1/L2
without a database query or a body. Real Redis, the real app under uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from examples.bookstore.db import SQLiteDatabase
from layered_cache import parse_config
from layered_cache.http import ETags, body_etag, cache_control, matches, strong_etag
from tests.test_example import _config, running

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def db() -> AsyncIterator[SQLiteDatabase]:
    database = SQLiteDatabase(":memory:", books=50, query_delay=0.01)
    await database.open()
    yield database
    await database.close()


@pytest.fixture
async def shop(redis_url: str, prefix: str, db: SQLiteDatabase) -> AsyncIterator[httpx.AsyncClient]:
    async with running(_config(redis_url, prefix), db) as client:
        yield client


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({}, "no-cache"),
        ({"cache": False}, "no-store"),
        ({"http": {"s_maxage": "30s", "stale_while_revalidate": "10s"}},
         "public, max-age=0, s-maxage=30, stale-while-revalidate=10"),
        ({"http": {"max_age": "1m", "private": True}}, "private, max-age=60"),
        ({"http": {"no_store": True}}, "no-store"),
    ],
)  # fmt: skip
def test_cache_control_follows_the_namespace_policy(
    table: dict[str, object], expected: str
) -> None:
    config = parse_config({"namespaces": {"book": {"key": "book:{id}", **table}}}, env={})
    assert cache_control(config.namespaces["book"]) == expected


def test_etags_are_strong_equal_for_equal_values_and_matched_like_rfc_9110() -> None:
    tag = strong_etag({"id": 1, "price": "9.90"})
    assert tag.startswith('"') and not tag.startswith("W/")
    assert tag == strong_etag({"id": 1, "price": "9.90"}) != strong_etag({"id": 1, "price": "9.91"})
    # Equal dicts in another key order render other JSON bytes: a strong tag differs too.
    assert tag != strong_etag({"price": "9.90", "id": 1})
    assert matches(f'"x", W/{tag}', tag) and matches("*", tag)
    assert not matches(None, tag) and not matches('"x"', tag)
    memo, value = ETags(max_entries=1), {"id": 1, "price": "9.90"}
    assert memo.of("k", value) == tag
    value["price"] = "0.01"  # the same object (an L1 hit): not hashed again
    assert memo.of("k", value) == tag
    assert memo.of("k", dict(value)) != tag  # a new fill: hashed once


async def test_a_book_page_carries_its_policy_and_an_etag(shop: httpx.AsyncClient) -> None:
    reply = await shop.get("/books/3")
    assert reply.status_code == 200
    assert reply.headers["cache-control"] == (
        "public, max-age=0, s-maxage=30, stale-while-revalidate=10"
    )
    assert reply.headers["etag"] == body_etag(reply.content, "application/json")
    assert reply.headers["x-cache-key"].endswith("book:3")
    stock = await shop.get("/books/3/stock")
    assert stock.headers["cache-control"] == "no-store" and "etag" not in stock.headers


async def test_an_unchanged_book_is_a_304_from_l1_or_l2_without_a_query_or_a_body(
    redis_url: str, prefix: str, db: SQLiteDatabase
) -> None:
    config = _config(redis_url, prefix)
    async with running(config, db, name="A") as a, running(config, db, name="B") as b:
        etag = (await a.get("/books/7")).headers["etag"]
        for client in (a, a, b, b):  # A from L1; B from L2 first, then its L1
            reply = await client.get("/books/7", headers={"If-None-Match": etag})
            assert reply.status_code == 304 and reply.content == b""
            assert reply.headers["etag"] == etag and "s-maxage=30" in reply.headers["cache-control"]
        assert db.queries["book_detail"] == 1
        stats = (await b.get("/stats")).json()["cache"]["book"]
        assert stats["l2_hit"] == 1 and stats["l1_hit"] >= 1 and stats["load"] == 0


async def test_a_price_change_changes_the_etag_so_the_old_one_gets_the_new_body(
    shop: httpx.AsyncClient,
) -> None:
    old = await shop.get("/books/11")
    assert (await shop.put("/books/11/price", json={"price": "1.23"})).status_code == 200
    reply = await shop.get("/books/11", headers={"If-None-Match": old.headers["etag"]})
    assert reply.status_code == 200 and reply.json()["price"] == "1.23"
    assert reply.headers["etag"] != old.headers["etag"]
