"""The bookstore's database: SQLite by default (stdlib, zero setup), PostgreSQL when
``DATABASE_URL`` is a postgres:// URL (needs ``asyncpg``, imported only then).

Every query is counted per kind (``db.queries["book_detail"]``), so the demo and the tests
can show what the cache saved: a stampede of 200 readers on a cold book is *one*
``book_detail`` query, and ``GET /books?ids=...`` loads all its misses in *one*
``book_details`` query. ``query_delay`` adds latency to each read, standing in for a join
on a loaded production database (without it SQLite answers in microseconds and no two
requests would ever overlap).

SQLite runs in a worker thread (``asyncio.to_thread``) behind one connection and a lock:
the event loop never blocks on it. The seed is deterministic (``random.Random(seed)``).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol
from urllib.parse import urlsplit

from examples.bookstore.models import BookDetail, CategoryBook, CategoryPage, Stock

__all__ = [
    "CATEGORIES",
    "PAGE_SIZE",
    "Database",
    "PostgresDatabase",
    "SQLiteDatabase",
    "open_database",
    "parse_price",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS authors (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS books (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, isbn TEXT NOT NULL, year INTEGER NOT NULL,
    author_id INTEGER NOT NULL REFERENCES authors(id));
CREATE TABLE IF NOT EXISTS prices (
    book_id INTEGER PRIMARY KEY REFERENCES books(id), amount_cents INTEGER NOT NULL,
    currency TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reviews (
    id INTEGER PRIMARY KEY, book_id INTEGER NOT NULL REFERENCES books(id),
    stars INTEGER NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS reviews_book ON reviews(book_id);
CREATE TABLE IF NOT EXISTS stock (
    book_id INTEGER PRIMARY KEY REFERENCES books(id), on_hand INTEGER NOT NULL,
    warehouse TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS categories (
    id INTEGER PRIMARY KEY, slug TEXT NOT NULL UNIQUE, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS book_categories (
    book_id INTEGER NOT NULL REFERENCES books(id),
    category_id INTEGER NOT NULL REFERENCES categories(id),
    PRIMARY KEY (category_id, book_id))
"""

# The book page: four tables, an aggregate over the reviews.
BOOK_DETAIL_SQL = """
SELECT b.id, b.title, b.isbn, b.year, a.id, a.name, p.amount_cents, p.currency,
       COUNT(r.id), AVG(r.stars)
FROM books b
JOIN authors a ON a.id = b.author_id
JOIN prices p ON p.book_id = b.id
LEFT JOIN reviews r ON r.book_id = b.id
WHERE b.id = ?
GROUP BY b.id, b.title, b.isbn, b.year, a.id, a.name, p.amount_cents, p.currency
"""
# Many books at once (GET /books?ids=...): the same join, one query for every id.
BOOK_DETAILS_SQL = BOOK_DETAIL_SQL.replace("WHERE b.id = ?", "WHERE b.id IN ({marks})")

# The category page: the category, how many books it has, and the first page of them by
# title, each with its author and price. LEFT JOINs: an empty category is one row of NULLs.
CATEGORY_PAGE_SQL = """
SELECT c.slug, c.name,
       (SELECT COUNT(*) FROM book_categories x WHERE x.category_id = c.id),
       b.id, b.title, a.name, p.amount_cents, p.currency
FROM categories c
LEFT JOIN book_categories bc ON bc.category_id = c.id
LEFT JOIN books b ON b.id = bc.book_id
LEFT JOIN authors a ON a.id = b.author_id
LEFT JOIN prices p ON p.book_id = b.id
WHERE c.slug = ?
ORDER BY b.title, b.id
LIMIT ?
"""
PAGE_SIZE = 20  # books on a category page
STOCK_SQL = "SELECT book_id, on_hand, warehouse FROM stock WHERE book_id = ?"
PRICE_SQL = "SELECT amount_cents FROM prices WHERE book_id = ?"
UPDATE_PRICE_SQL = "UPDATE prices SET amount_cents = ? WHERE book_id = ?"
UPDATE_STOCK_SQL = "UPDATE stock SET on_hand = ? WHERE book_id = ?"

_FIRST = ["Ada", "Jorge", "Ursula", "Italo", "Toni", "Haruki", "Clarice", "Chinua", "Wislawa",
          "Olga", "Naguib", "Kazuo", "Zadie", "Orhan", "Elena", "Mario", "Yoko", "Tove"]
_LAST = ["Lovelace", "Borges", "Le Guin", "Calvino", "Morrison", "Murakami", "Lispector",
         "Achebe", "Szymborska", "Tokarczuk", "Mahfouz", "Ishiguro", "Smith", "Pamuk",
         "Ferrante", "Vargas", "Ogawa", "Jansson"]
_WORDS = ["Silent", "River", "Glass", "Winter", "Garden", "Cartographer", "Night", "Orchard",
          "Memory", "Salt", "Invisible", "Cities", "Lighthouse", "Archive", "Paper", "Moon",
          "Labyrinth", "Harbor", "Clock", "Library", "Northern", "Fire", "Atlas", "Wind"]
# (id, slug, name): every book is in one or two of them.
CATEGORIES = [
    (1, "scifi", "Science fiction"), (2, "poetry", "Poetry"), (3, "crime", "Crime"),
    (4, "history", "History"), (5, "essays", "Essays"), (6, "travel", "Travel"),
]
_COUNTRIES = ["AR", "BR", "DE", "ES", "FR", "GB", "IT", "JP", "NG", "PL", "SE", "TR", "US"]


def parse_price(text: str) -> int:
    """``"9.90"`` -> 990 cents. A positive decimal with at most two places, else ValueError."""
    if not re.fullmatch(r"\d{1,7}(\.\d{1,2})?", text.strip()):
        raise ValueError(f'price must be a decimal like "9.90", got {text!r}')
    try:
        cents = int(Decimal(text.strip()) * 100)
    except InvalidOperation:
        raise ValueError(f"price must be a decimal, got {text!r}") from None
    if cents <= 0:
        raise ValueError(f"price must be > 0, got {text!r}")
    return cents


def format_price(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def seed_rows(books: int = 1000, seed: int = 42) -> dict[str, list[tuple[Any, ...]]]:
    """Deterministic rows: ~books/5 authors, a price and stock per book, ~8 reviews each."""
    rng = random.Random(seed)
    n_authors = max(1, books // 5)
    authors = [
        (i, f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", rng.choice(_COUNTRIES))
        for i in range(1, n_authors + 1)
    ]
    rows: dict[str, list[tuple[Any, ...]]] = {
        "authors": authors, "books": [], "prices": [], "reviews": [], "stock": []
    }
    review_id = 0
    for i in range(1, books + 1):
        title = " ".join(rng.sample(_WORDS, rng.randint(2, 4)))
        isbn = f"978{rng.randrange(10**9, 10**10)}"
        rows["books"].append((i, title, isbn, rng.randint(1900, 2025), rng.randint(1, n_authors)))
        rows["prices"].append((i, rng.randint(5, 60) * 100 + rng.choice([0, 50, 90, 99]), "EUR"))
        rows["stock"].append((i, rng.randint(0, 40), rng.choice(["BER", "LIS", "MAD"])))
        for _ in range(rng.randint(0, 16)):
            review_id += 1
            rows["reviews"].append((review_id, i, rng.randint(1, 5), "ok"))
    rows.update(category_rows(range(1, books + 1), seed))
    return rows


def category_rows(book_ids: Iterable[int], seed: int = 42) -> dict[str, list[tuple[Any, ...]]]:
    """The categories and one or two of them per book. A random stream of its own, so
    the rows above stay what they were before categories existed, and a database seeded
    before them gets the same categories for its books (``open`` adds them)."""
    rng = random.Random(f"{seed}:categories")
    links: list[tuple[Any, ...]] = []
    for book_id in book_ids:
        for category in rng.sample(CATEGORIES, rng.randint(1, 2)):
            links.append((book_id, category[0]))
    return {"categories": list(CATEGORIES), "book_categories": links}


class Database(Protocol):
    """What the service needs from a database. ``queries`` counts per query kind."""

    queries: Counter[str]
    query_delay: float
    kind: str

    @property
    def identity(self) -> str:
        """Which database this is (kind and location, never a password): cached values
        from one database must not be served for another (app.claim_cache_prefix)."""
        ...

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def ping(self) -> bool: ...
    async def book_detail(self, book_id: int) -> BookDetail | None: ...
    async def book_details(self, book_ids: Sequence[int]) -> dict[int, BookDetail]:
        """The books that exist among ``book_ids``, in one query."""
        ...

    async def category_page(self, slug: str) -> CategoryPage | None: ...
    async def stock(self, book_id: int) -> Stock | None: ...
    async def update_price(self, book_id: int, cents: int) -> str | None: ...
    async def set_stock(self, book_id: int, on_hand: int) -> bool: ...


def _detail(row: tuple[Any, ...] | None) -> BookDetail | None:
    if row is None:
        return None
    avg = row[9]
    return BookDetail(
        id=int(row[0]), title=row[1], isbn=row[2], year=int(row[3]), author_id=int(row[4]),
        author=row[5], price=format_price(int(row[6])), currency=row[7],
        review_count=int(row[8]), rating=None if avg is None else round(float(avg), 2),
    )


def _category_page(rows: Sequence[tuple[Any, ...]]) -> CategoryPage | None:
    if not rows:
        return None
    slug, name, count = rows[0][:3]
    books = [
        CategoryBook(
            id=int(r[3]), title=r[4], author=r[5], price=format_price(int(r[6])), currency=r[7]
        )
        for r in rows
        if r[3] is not None
    ]
    return CategoryPage(slug=slug, name=name, book_count=int(count), books=books)


def _marks(count: int) -> str:
    return ",".join("?" * count)


class SQLiteDatabase:
    """SQLite via the stdlib module, one connection used from worker threads under a lock."""

    kind = "sqlite"

    def __init__(self, path: str = ":memory:", *, books: int = 1000, query_delay: float = 0.0) -> None:
        self.path = path
        self.books = books
        self.query_delay = query_delay
        self.queries: Counter[str] = Counter()
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @property
    def identity(self) -> str:
        return "sqlite::memory:" if self.path == ":memory:" else f"sqlite:{os.path.abspath(self.path)}"

    async def open(self) -> None:
        if self._conn is None:
            await asyncio.to_thread(self._open_sync)

    def _open_sync(self) -> None:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL" if self.path != ":memory:" else "PRAGMA foreign_keys=ON")
        conn.executescript(SCHEMA)
        if conn.execute("SELECT COUNT(*) FROM books").fetchone()[0] == 0:
            rows = seed_rows(self.books)
            conn.execute("BEGIN")
            for table, values in rows.items():
                marks = ",".join("?" * len(values[0])) if values else ""
                if values:
                    conn.executemany(f"INSERT INTO {table} VALUES ({marks})", values)
            conn.execute("COMMIT")
        elif conn.execute("SELECT COUNT(*) FROM categories").fetchone()[0] == 0:
            # Seeded before categories existed: add them for the books it has.
            ids = [row[0] for row in conn.execute("SELECT id FROM books ORDER BY id")]
            conn.execute("BEGIN")
            for table, values in category_rows(ids).items():
                conn.executemany(f"INSERT INTO {table} VALUES ({_marks(len(values[0]))})", values)
            conn.execute("COMMIT")
        self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await asyncio.to_thread(conn.close)

    def _run(self, sql: str, params: tuple[Any, ...], write: bool, many: bool = False) -> Any:
        with self._lock:
            if self._conn is None:
                raise RuntimeError("database is not open")
            cursor = self._conn.execute(sql, params)
            if write:
                return cursor.rowcount
            return cursor.fetchall() if many else cursor.fetchone()

    async def _query(
        self, kind: str, sql: str, *params: Any, write: bool = False, many: bool = False
    ) -> Any:
        self.queries[kind] += 1
        if self.query_delay and not write:
            await asyncio.sleep(self.query_delay)
        return await asyncio.to_thread(self._run, sql, params, write, many)

    async def ping(self) -> bool:
        return bool(await asyncio.to_thread(self._run, "SELECT 1", (), False) == (1,))

    async def book_detail(self, book_id: int) -> BookDetail | None:
        return _detail(await self._query("book_detail", BOOK_DETAIL_SQL, book_id))

    async def book_details(self, book_ids: Sequence[int]) -> dict[int, BookDetail]:
        sql = BOOK_DETAILS_SQL.format(marks=_marks(len(book_ids)))
        rows = await self._query("book_details", sql, *book_ids, many=True)
        return {detail.id: detail for detail in map(_detail, rows) if detail is not None}

    async def category_page(self, slug: str) -> CategoryPage | None:
        rows = await self._query("category_page", CATEGORY_PAGE_SQL, slug, PAGE_SIZE, many=True)
        return _category_page(rows)

    async def stock(self, book_id: int) -> Stock | None:
        row = await self._query("stock", STOCK_SQL, book_id)
        return None if row is None else Stock(book_id=row[0], on_hand=row[1], warehouse=row[2])

    async def update_price(self, book_id: int, cents: int) -> str | None:
        """Set the price; returns the old one (``None``: no such book)."""

        def update() -> str | None:
            with self._lock:
                assert self._conn is not None
                row = self._conn.execute(PRICE_SQL, (book_id,)).fetchone()
                if row is None:
                    return None
                self._conn.execute(UPDATE_PRICE_SQL, (cents, book_id))
                return format_price(int(row[0]))

        self.queries["update_price"] += 1
        return await asyncio.to_thread(update)

    async def set_stock(self, book_id: int, on_hand: int) -> bool:
        return bool(await self._query("set_stock", UPDATE_STOCK_SQL, on_hand, book_id, write=True))


def _pg(sql: str) -> str:
    """``?`` placeholders -> ``$1, $2, ...`` (asyncpg)."""
    count = 0

    def repl(_: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return f"${count}"

    return re.sub(r"\?", repl, sql)


class PostgresDatabase:
    """PostgreSQL via asyncpg (optional dependency: ``pip install asyncpg``)."""

    kind = "postgres"

    def __init__(self, url: str, *, books: int = 1000, query_delay: float = 0.0) -> None:
        self.url = url
        self.books = books
        self.query_delay = query_delay
        self.queries: Counter[str] = Counter()
        self._pool: Any = None

    @property
    def identity(self) -> str:
        parts = urlsplit(self.url)
        user = f"{parts.username}@" if parts.username else ""
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"postgresql://{user}{host}{port}{parts.path}"

    async def open(self) -> None:
        try:
            import asyncpg  # type: ignore[import-not-found]
        except ImportError:
            raise RuntimeError(
                "DATABASE_URL is a PostgreSQL URL but asyncpg is not installed: "
                "pip install asyncpg (or unset DATABASE_URL to use SQLite)"
            ) from None
        self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=10)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(4242)")  # one seeder at a time
            await conn.execute(SCHEMA)
            if await conn.fetchval("SELECT COUNT(*) FROM books") == 0:
                for table, values in seed_rows(self.books).items():
                    if values:
                        await conn.copy_records_to_table(table, records=values)
            elif await conn.fetchval("SELECT COUNT(*) FROM categories") == 0:
                # Seeded before categories existed: add them for the books it has.
                ids = [r[0] for r in await conn.fetch("SELECT id FROM books ORDER BY id")]
                for table, values in category_rows(ids).items():
                    await conn.copy_records_to_table(table, records=values)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _fetchrow(self, kind: str, sql: str, *params: Any) -> Any:
        self.queries[kind] += 1
        if self.query_delay:
            await asyncio.sleep(self.query_delay)
        row = await self._pool.fetchrow(_pg(sql), *params)
        return None if row is None else tuple(row)

    async def _fetch(self, kind: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        self.queries[kind] += 1
        if self.query_delay:
            await asyncio.sleep(self.query_delay)
        return [tuple(row) for row in await self._pool.fetch(_pg(sql), *params)]

    async def ping(self) -> bool:
        return bool(await self._pool.fetchval("SELECT 1") == 1)

    async def book_detail(self, book_id: int) -> BookDetail | None:
        return _detail(await self._fetchrow("book_detail", BOOK_DETAIL_SQL, book_id))

    async def book_details(self, book_ids: Sequence[int]) -> dict[int, BookDetail]:
        sql = BOOK_DETAILS_SQL.format(marks=_marks(len(book_ids)))
        rows = await self._fetch("book_details", sql, *book_ids)
        return {detail.id: detail for detail in map(_detail, rows) if detail is not None}

    async def category_page(self, slug: str) -> CategoryPage | None:
        return _category_page(await self._fetch("category_page", CATEGORY_PAGE_SQL, slug, PAGE_SIZE))

    async def stock(self, book_id: int) -> Stock | None:
        row = await self._fetchrow("stock", STOCK_SQL, book_id)
        return None if row is None else Stock(book_id=row[0], on_hand=row[1], warehouse=row[2])

    async def update_price(self, book_id: int, cents: int) -> str | None:
        self.queries["update_price"] += 1
        async with self._pool.acquire() as conn, conn.transaction():
            old = await conn.fetchval(_pg(PRICE_SQL + " FOR UPDATE"), book_id)
            if old is None:
                return None
            await conn.execute(_pg(UPDATE_PRICE_SQL), cents, book_id)
        return format_price(int(old))

    async def set_stock(self, book_id: int, on_hand: int) -> bool:
        self.queries["set_stock"] += 1
        status = await self._pool.execute(_pg(UPDATE_STOCK_SQL), on_hand, book_id)
        return bool(status.endswith(" 1"))


def open_database(
    url: str | None = None, *, books: int = 1000, query_delay: float | None = None
) -> Database:
    """The database for ``url`` (default ``$DATABASE_URL``): postgres:// or postgresql://
    -> PostgreSQL; ``sqlite:///path`` or unset -> SQLite (``:memory:`` when no path).
    Not opened yet: call ``await db.open()`` (the app's lifespan does)."""
    url = url if url is not None else os.environ.get("DATABASE_URL", "")
    delay = (
        float(os.environ.get("BOOKSTORE_QUERY_DELAY", "0.02")) if query_delay is None else query_delay
    )
    if url.startswith(("postgres://", "postgresql://")):
        return PostgresDatabase(url, books=books, query_delay=delay)
    if url.startswith("sqlite://"):
        # SQLAlchemy style: sqlite:///relative.db, sqlite:////absolute/path.db, sqlite://
        path = url.removeprefix("sqlite://").removeprefix("/") or ":memory:"
        return SQLiteDatabase(path, books=books, query_delay=delay)
    if url:
        raise ValueError(f"DATABASE_URL must be postgres://..., postgresql://... or sqlite:///path, got {url!r}")
    return SQLiteDatabase(":memory:", books=books, query_delay=delay)
