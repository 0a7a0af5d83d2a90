"""The bookstore example (examples/bookstore) served by uvicorn, driven through httpx,
against real Redis - and, for the price change, a real broker and the invalidation daemon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from examples.bookstore.app import (
    METRICS_FORMAT,
    BookstoreSettings,
    create_app,
    load_bookstore_config,
    serve,
)
from examples.bookstore.db import (
    CATEGORIES,
    PAGE_SIZE,
    PostgresDatabase,
    SQLiteDatabase,
    parse_price,
    seed_rows,
)
from layered_cache import Config
from tests.helpers import eventually
from tests.servers import create_topic

pytestmark = pytest.mark.timeout(60)

FAST_GROUP = {"session_timeout": "2s", "heartbeat_interval": "200ms", "rebalance_timeout": "1s"}


def _config(redis_url: str, prefix: str, **kwargs: Any) -> Config:
    return load_bookstore_config(
        redis_url=redis_url,
        prefix=prefix,
        overrides={"kafka": FAST_GROUP, "logging": {"level": "error"}},
        env={},
        **kwargs,
    )


@contextlib.asynccontextmanager
async def running(
    config: Config, db: SQLiteDatabase, *, kafka: bool = False, name: str = "test"
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(BookstoreSettings(config=config, db=db, produce_events=kafka, name=name))
    async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
        yield client


@pytest.fixture
async def db() -> AsyncIterator[SQLiteDatabase]:
    database = SQLiteDatabase(":memory:", books=200, query_delay=0.05)
    await database.open()
    yield database
    await database.close()


@pytest.fixture
async def shop(redis_url: str, prefix: str, db: SQLiteDatabase) -> AsyncIterator[httpx.AsyncClient]:
    async with running(_config(redis_url, prefix), db) as client:
        yield client


async def test_stampede_on_a_cold_book_is_one_query(
    shop: httpx.AsyncClient, db: SQLiteDatabase
) -> None:
    replies = await asyncio.gather(*(shop.get("/books/17") for _ in range(100)))
    assert {r.status_code for r in replies} == {200}
    assert len({r.content for r in replies}) == 1
    assert db.queries["book_detail"] == 1
    body = replies[0].json()
    assert body["id"] == 17 and body["price"] and body["author"]
    assert {"title", "review_count", "rating", "currency"} <= set(body)


async def test_stampede_across_two_instances_is_one_query(
    redis_url: str, prefix: str, db: SQLiteDatabase
) -> None:
    config = _config(redis_url, prefix)
    async with running(config, db, name="A") as a, running(config, db, name="B") as b:
        replies = await asyncio.gather(*(c.get("/books/23") for c in [a, b] * 40))
        assert {r.status_code for r in replies} == {200}
        assert db.queries["book_detail"] == 1  # the lease: one load across instances
        stats = {
            n: (await c.get("/stats")).json()["cache"]["book"] for n, c in (("A", a), ("B", b))
        }
        assert stats["A"]["load"] + stats["B"]["load"] == 1


async def test_reads_after_the_fill_never_touch_the_database(
    shop: httpx.AsyncClient, db: SQLiteDatabase
) -> None:
    for _ in range(20):
        assert (await shop.get("/books/5")).status_code == 200
    assert db.queries["book_detail"] == 1
    book = (await shop.get("/stats")).json()["cache"]["book"]
    assert book["l1_hit"] >= 19


async def test_stock_is_never_cached(shop: httpx.AsyncClient, db: SQLiteDatabase) -> None:
    first = (await shop.get("/books/9/stock")).json()
    for on_hand in (first["on_hand"] + 5, 0, 3):
        reply = await shop.put("/books/9/stock", json={"on_hand": on_hand})
        assert reply.status_code == 200
        assert (await shop.get("/books/9/stock")).json()["on_hand"] == on_hand
    assert db.queries["stock"] == 4
    stock = (await shop.get("/stats")).json()["cache"]["stock"]
    assert stock["l1_hit"] == stock["l2_hit"] == 0
    assert stock["load"] == 4


async def test_price_change_without_kafka_invalidates_directly(
    shop: httpx.AsyncClient, db: SQLiteDatabase
) -> None:
    old = (await shop.get("/books/11")).json()["price"]
    new = "7.50" if old != "7.50" else "8.50"
    reply = await shop.put("/books/11/price", json={"price": new})
    assert reply.status_code == 200
    assert reply.json() == {
        "book_id": 11,
        "old_price": old,
        "new_price": new,
        "invalidation": "direct",
    }
    assert (await shop.get("/books/11")).json()["price"] == new
    assert db.queries["book_detail"] == 2


class RecordingDatabase(SQLiteDatabase):
    """The example's SQLite database, also noting which ids each many-books query asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[int]] = []

    async def book_details(self, book_ids: Any) -> Any:
        self.batches.append(list(book_ids))
        return await super().book_details(book_ids)


async def test_get_books_by_ids_returns_them_in_order_with_one_query_for_the_misses(
    redis_url: str, prefix: str
) -> None:
    db = RecordingDatabase(":memory:", books=200, query_delay=0.05)
    await db.open()
    try:
        config = _config(redis_url, prefix)
        async with running(config, db, name="A") as a, running(config, db, name="B") as b:
            for book in (5, 7):  # already cached through GET /books/{id}
                assert (await a.get(f"/books/{book}")).status_code == 200
            reply = await a.get("/books", params={"ids": "7,3,5,11,2,3"})
            assert reply.status_code == 200
            books = reply.json()
            assert [book["id"] for book in books] == [7, 3, 5, 11, 2, 3]
            assert books[1] == books[5] and books[0] == (await a.get("/books/7")).json()
            assert db.batches == [[3, 11, 2]]  # one query, for the misses only
            assert db.queries["book_details"] == 1 and db.queries["book_detail"] == 2

            # The batch filled the same keys GET /books/{id} reads, in both layers:
            # A answers from L1, B (cold L1) from one MGET; no instance queries again.
            assert (await a.get("/books/11")).json() == books[3]
            assert (await b.get("/books", params={"ids": "2,5,11,3,7"})).json() == [
                books[4],
                books[2],
                books[3],
                books[1],
                books[0],
            ]
            assert db.batches == [[3, 11, 2]] and db.queries["book_detail"] == 2
            cache_b = (await b.get("/stats")).json()["cache"]["book"]
            assert cache_b["l2_hit"] == 5 and cache_b["load"] == 0
    finally:
        await db.close()


async def test_get_books_by_ids_errors(shop: httpx.AsyncClient, db: SQLiteDatabase) -> None:
    reply = await shop.get("/books", params={"ids": "1,99999,2,88888"})
    assert reply.status_code == 404
    assert reply.json() == {"error": "no book 99999, 88888"}
    # A missing book is never cached: asked again, the batch queries again.
    assert (await shop.get("/books", params={"ids": "99999"})).status_code == 404
    assert db.queries["book_details"] == 2
    for bad in ("", "1,,2", "1,abc", ",".join(["1"] * 101)):
        reply = await shop.get("/books", params={"ids": bad})
        assert reply.status_code == 422, bad
        assert "error" in reply.json()
    assert (await shop.get("/books")).status_code == 422
    assert db.queries["book_details"] == 2


async def test_errors(shop: httpx.AsyncClient, db: SQLiteDatabase) -> None:
    assert (await shop.get("/books/99999")).status_code == 404
    assert (await shop.get("/books/99999/stock")).status_code == 404
    assert (await shop.put("/books/99999/price", json={"price": "1.00"})).status_code == 404
    for bad in ({"price": "abc"}, {"price": "-1"}, {"price": "0"}, {"price": 3}, {}):
        reply = await shop.put("/books/1/price", json=bad)
        assert reply.status_code == 422, bad
        assert "error" in reply.json()
    assert (await shop.put("/books/1/stock", json={"on_hand": -1})).status_code == 422
    # A missing book is a 404 every time, never a cached "None".
    assert (await shop.get("/books/99999")).status_code == 404
    assert db.queries["book_detail"] == 2


async def test_metrics_show_the_counters(shop: httpx.AsyncClient) -> None:
    await asyncio.gather(*(shop.get("/books/3") for _ in range(10)))
    await shop.get("/books/3")
    reply = await shop.get("/metrics")
    assert reply.status_code == 200
    if METRICS_FORMAT == "prometheus":
        assert reply.headers["content-type"].startswith("text/plain")
        lines = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in reply.text.splitlines()
            if line and not line.startswith("#")
        }
        assert lines['layered_cache_requests_total{namespace="book",result="l1_hit"}'] >= 1
        assert lines['layered_cache_loads_total{namespace="book"}'] == 1
        assert lines['layered_cache_coalesced_total{namespace="book"}'] >= 1
    else:
        book = reply.json()["cache"]["book"]
        assert book["load"] == 1 and book["l1_hit"] >= 1


async def test_healthz(shop: httpx.AsyncClient) -> None:
    reply = await shop.get("/healthz")
    assert reply.status_code == 200
    assert reply.json()["status"] == "ok"
    assert reply.json()["redis_breaker"] == "closed"


def test_price_parsing_and_seed() -> None:
    assert parse_price("9.90") == 990
    assert parse_price("12") == 1200
    assert parse_price("0.05") == 5
    for bad in ("", "1.999", "-3", "1e3", "0.00", "abc"):
        with pytest.raises(ValueError):
            parse_price(bad)
    rows = seed_rows(1000)
    assert len(rows["books"]) == 1000 and len(rows["authors"]) == 200
    assert rows == seed_rows(1000)  # deterministic
    assert rows["categories"] == CATEGORIES
    per_book = Counter(book for book, _ in rows["book_categories"])
    assert set(per_book) == set(range(1, 1001)) and set(per_book.values()) == {1, 2}


async def test_a_database_seeded_before_categories_gets_them_on_open(tmp_path: Any) -> None:
    path = str(tmp_path / "old.db")
    old = SQLiteDatabase(path, books=50)
    await old.open()
    await old.close()
    conn = sqlite3.connect(path)
    with conn:  # as it was before categories existed
        conn.executescript("DROP TABLE book_categories; DROP TABLE categories;")
    conn.close()
    upgraded = SQLiteDatabase(path, books=50)
    await upgraded.open()
    try:
        page = await upgraded.category_page("scifi")
        fresh = SQLiteDatabase(":memory:", books=50)
        await fresh.open()
        try:
            assert page is not None and page == await fresh.category_page("scifi")
        finally:
            await fresh.close()
    finally:
        await upgraded.close()


@contextlib.asynccontextmanager
async def daemon_running(config: Config) -> AsyncIterator[Any]:
    from layered_cache.daemon import Daemon

    daemon = Daemon(config, health_port=0)
    task = asyncio.ensure_future(daemon.run())
    try:
        assert await eventually(lambda: task.done() or bool(daemon.assignment), timeout=20)
        if task.done():
            task.result()
        yield daemon
    finally:
        daemon.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def test_price_change_reaches_every_instance_through_kafka_and_the_daemon(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str, db: SQLiteDatabase
) -> None:
    await create_topic(kafka_bootstrap, unique_topic, partitions=2)
    config = _config(
        redis_url,
        prefix,
        kafka_bootstrap=kafka_bootstrap,
        topic=unique_topic,
        group_id=f"g-{unique_topic}",
    )
    async with (
        daemon_running(config) as daemon,
        running(config, db, kafka=True, name="A") as a,
        running(config, db, kafka=True, name="B") as b,
    ):
        old = (await a.get("/books/42")).json()["price"]
        assert (await b.get("/books/42")).json()["price"] == old  # both hold it in L1
        new = "9.90" if old != "9.90" else "8.90"
        reply = await a.put("/books/42/price", json={"price": new})
        assert reply.status_code == 200
        assert reply.json()["invalidation"] == f"kafka:{unique_topic}"
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def sees_new_price(client: httpx.AsyncClient) -> bool:
            return bool((await client.get("/books/42")).json()["price"] == new)

        assert await eventually(lambda: sees_new_price(a), timeout=10, interval=0.01)
        assert await eventually(lambda: sees_new_price(b), timeout=10, interval=0.01)
        took = loop.time() - started
        # The contract is "within a second"; a loaded CI box gets some slack.
        assert took < 3.0, f"price change took {took:.2f}s to reach both instances"
        assert daemon.stats.events == 1 and daemon.stats.keys == 1
        assert db.queries["book_detail"] == 2  # the first fill and one reload after the change


async def test_a_category_page_is_one_query_then_served_from_the_cache(
    redis_url: str, prefix: str, db: SQLiteDatabase
) -> None:
    config = _config(redis_url, prefix)
    async with running(config, db, name="A") as a, running(config, db, name="B") as b:
        replies = await asyncio.gather(*(c.get("/categories/scifi") for c in [a, b] * 20))
        assert {r.status_code for r in replies} == {200}
        assert len({r.content for r in replies}) == 1
        page = replies[0].json()
        assert page["slug"] == "scifi" and page["name"] == "Science fiction"
        assert 0 < len(page["books"]) <= PAGE_SIZE <= page["book_count"]
        titles = [(book["title"], book["id"]) for book in page["books"]]
        assert titles == sorted(titles)
        first = page["books"][0]
        detail = (await a.get(f"/books/{first['id']}")).json()
        assert {k: detail[k] for k in first} == first
        before = (await b.get("/stats")).json()["cache"]["category"]
        for _ in range(10):
            assert (await b.get("/categories/scifi")).json() == page
        assert db.queries["category_page"] == 1  # one load, for 50 reads on two instances
        stats = [(await c.get("/stats")).json()["cache"]["category"] for c in (a, b)]
        assert sum(s["load"] for s in stats) == 1
        # B's 10 reads: from L1 (the first may be an L2 hit: an instance that waited for
        # the other's fill of a tagged entry reads it from Redis once).
        assert stats[1]["l1_hit"] - before["l1_hit"] >= 9
        assert stats[1]["l1_hit"] + stats[1]["l2_hit"] - before["l1_hit"] - before["l2_hit"] == 10

        assert (await a.get("/categories/no-such-thing")).status_code == 404
        assert (await a.get("/categories/no-such-thing")).status_code == 404
        assert (await a.get("/categories/Sci%20Fi")).status_code == 404  # never a key
        assert db.queries["category_page"] == 3  # a missing category is never cached


async def _pages_showing(
    client: httpx.AsyncClient, book: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A category page and a book on it, and another page that doesn't show that book."""
    pages = {slug: (await client.get(f"/categories/{slug}")).json() for _, slug, _ in CATEGORIES}
    for page in pages.values():
        for shown in page["books"]:
            if book is None or shown["id"] == book:
                for other in pages.values():
                    if shown["id"] not in {b["id"] for b in other["books"]}:
                        return page, other
    raise AssertionError("the seed has no such pages")


def _price_on(page: dict[str, Any], book: int) -> str:
    (price,) = [shown["price"] for shown in page["books"] if shown["id"] == book]
    return str(price)


async def test_a_price_change_without_kafka_kills_the_category_pages_on_both_instances(
    redis_url: str, prefix: str, db: SQLiteDatabase
) -> None:
    """No Kafka: PUT /books/{id}/price invalidates the book and the tag book:{id} itself,
    and the backplane drops both instances' L1 copies."""
    config = _config(redis_url, prefix)
    async with running(config, db, name="A") as a, running(config, db, name="B") as b:
        page, other = await _pages_showing(a)
        book = page["books"][0]["id"]
        for client in (a, b):  # both instances hold both pages in L1
            assert (await client.get(f"/categories/{page['slug']}")).json() == page
            assert (await client.get(f"/categories/{other['slug']}")).json() == other
        loads = db.queries["category_page"]
        old = _price_on(page, book)
        new = "7.50" if old != "7.50" else "8.50"
        reply = await b.put(f"/books/{book}/price", json={"price": new})
        assert reply.json()["invalidation"] == "direct"

        async def page_shows_new_price(client: httpx.AsyncClient) -> bool:
            reply = await client.get(f"/categories/{page['slug']}")
            return _price_on(reply.json(), book) == new

        assert await eventually(lambda: page_shows_new_price(a), timeout=10)
        assert await eventually(lambda: page_shows_new_price(b), timeout=10)
        assert (await a.get(f"/books/{book}")).json()["price"] == new
        for client in (a, b):  # the page without the book was never touched
            assert (await client.get(f"/categories/{other['slug']}")).json() == other
        assert db.queries["category_page"] == loads + 1  # one reload, of the dead page


async def test_a_price_change_event_reaches_the_category_page_on_both_instances(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str, db: SQLiteDatabase
) -> None:
    """PUT /books/{id}/price produces BookPriceChanged; the daemon's route
    (bookstore.toml) deletes book:{id} and kills the tag book:{id}: both instances'
    category pages showing the book reload with the new price, the others stay."""
    await create_topic(kafka_bootstrap, unique_topic, partitions=2)
    config = _config(
        redis_url,
        prefix,
        kafka_bootstrap=kafka_bootstrap,
        topic=unique_topic,
        group_id=f"g-{unique_topic}",
    )
    async with (
        daemon_running(config) as daemon,
        running(config, db, kafka=True, name="A") as a,
        running(config, db, kafka=True, name="B") as b,
    ):
        page, other = await _pages_showing(a)
        book = page["books"][-1]["id"]
        for client in (a, b):
            assert (await client.get(f"/categories/{page['slug']}")).json() == page
            assert (await client.get(f"/categories/{other['slug']}")).json() == other
        loads = db.queries["category_page"]
        old = _price_on(page, book)
        new = "9.90" if old != "9.90" else "8.90"
        reply = await a.put(f"/books/{book}/price", json={"price": new})
        assert reply.json()["invalidation"] == f"kafka:{unique_topic}"
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def page_shows_new_price(client: httpx.AsyncClient) -> bool:
            reply = await client.get(f"/categories/{page['slug']}")
            return _price_on(reply.json(), book) == new

        assert await eventually(lambda: page_shows_new_price(a), timeout=10, interval=0.01)
        assert await eventually(lambda: page_shows_new_price(b), timeout=10, interval=0.01)
        took = loop.time() - started
        assert took < 3.0, f"the price took {took:.2f}s to reach both instances' pages"
        assert daemon.stats.events == 1 and daemon.stats.tags_invalidated == 1
        for client in (a, b):
            assert (await client.get(f"/categories/{other['slug']}")).json() == other
        assert db.queries["category_page"] == loads + 1


async def test_the_service_runs_on_postgresql_too(redis_url: str, prefix: str) -> None:
    """DATABASE_URL (or the machine's local PostgreSQL) in a database of the test's own."""
    asyncpg = pytest.importorskip("asyncpg")
    admin_url = os.environ.get("DATABASE_URL") or "postgresql://postgres@127.0.0.1:5432/postgres"
    try:
        admin = await asyncpg.connect(admin_url, timeout=3)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.skip(f"no PostgreSQL reachable at {admin_url}: {exc}")
    name = f"lc_{uuid.uuid4().hex[:10]}"
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        database = PostgresDatabase(
            f"{admin_url.rsplit('/', 1)[0]}/{name}", books=100, query_delay=0.05
        )
        await database.open()
        try:
            async with running(_config(redis_url, prefix), database) as shop:  # type: ignore[arg-type]
                replies = await asyncio.gather(*(shop.get("/books/17") for _ in range(50)))
                assert {r.status_code for r in replies} == {200}
                assert database.queries["book_detail"] == 1
                assert (
                    await shop.put("/books/17/price", json={"price": "3.30"})
                ).status_code == 200
                assert (await shop.get("/books/17")).json()["price"] == "3.30"
                assert (await shop.get("/books/17/stock")).status_code == 200
                # The category page and the batch, on PostgreSQL's queries.
                page, _ = await _pages_showing(shop)
                book = page["books"][0]["id"]
                assert (
                    await shop.put(f"/books/{book}/price", json={"price": "4.40"})
                ).status_code == 200
                page = (await shop.get(f"/categories/{page['slug']}")).json()
                assert _price_on(page, book) == "4.40"
                ids = [book, 3, 17, 2]
                books = (await shop.get("/books", params={"ids": ",".join(map(str, ids))})).json()
                assert [b["id"] for b in books] == ids and books[2]["price"] == "3.30"
                assert database.queries["book_details"] == 1
                assert (await shop.get("/books", params={"ids": "1,99999"})).status_code == 404
        finally:
            await database.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_a_second_database_on_the_same_cache_prefix_is_warned_about(
    redis_url: str, prefix: str, tmp_path: Any
) -> None:
    """Switching databases on one prefix would serve the first one's cached prices: the
    service records which database fills the prefix and warns when it is another."""
    from structlog.testing import capture_logs

    config = _config(redis_url, prefix)
    first = SQLiteDatabase(str(tmp_path / "a.db"), books=20)
    second = SQLiteDatabase(str(tmp_path / "b.db"), books=20)
    await first.open()
    await second.open()
    try:
        with capture_logs() as logs:
            async with running(config, first) as shop:
                assert (await shop.get("/books/1")).status_code == 200
            async with running(config, first):  # the same database again: fine
                pass
            first_two = [entry["event"] for entry in logs]
            async with running(config, second):
                pass
            async with running(_config(redis_url, f"{prefix}b:"), second):  # own prefix
                pass
    finally:
        await first.close()
        await second.close()
    assert "cache_prefix_shared_with_another_database" not in first_two
    warnings = [e for e in logs if e["event"] == "cache_prefix_shared_with_another_database"]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["cached_from"] == first.identity == f"sqlite:{tmp_path / 'a.db'}"
    assert warnings[0]["database"] == second.identity
    assert f"LAYERED_CACHE_REDIS_PREFIX={prefix}" in warnings[0]["fix"]


def test_a_postgresql_identity_never_holds_the_password() -> None:
    database = PostgresDatabase("postgresql://shop:s3cret@db.internal:5433/books")
    assert database.identity == "postgresql://shop@db.internal:5433/books"
    assert SQLiteDatabase(":memory:").identity == "sqlite::memory:"
