"""The bookstore service (Starlette): layered_cache in front of an expensive join.

    GET  /books/{id}         book detail (book + author + price + review count), cached
                             in namespace "book" (L1 -> L2 -> one DB query per key fleet-wide),
                             with Cache-Control from its http policy, an ETag, and a 304
                             for a matching If-None-Match (layered_cache.asgi)
    GET  /books?ids=1,2,3    many books in the order asked, through get_or_load_many: L1,
                             one MGET, then one DB query for all the misses
    GET  /categories/{slug}  a category page listing books with their prices, cached in
                             namespace "category" (tags = true), tagged book:{id} for each
                             book on it: a price change of any of them kills the page
    PUT  /books/{id}/price   {"price": "9.90"}: update the DB, then produce BookPriceChanged
                             to Kafka; the invalidation daemon deletes book:{id} and kills
                             the tag book:{id} in Redis, and the backplane drops every
                             instance's L1 copies (the book and the pages showing it)
    GET  /books/{id}/stock   namespace "stock" has cache = false: always read live
    PUT  /books/{id}/stock   {"on_hand": 3} (so the demo can show stock is never stale)
    GET  /metrics            Prometheus text (layered_cache.prometheus) or, without it, JSON
    GET  /stats              JSON: cache counters per namespace, hot keys, DB query counts
    GET  /healthz            200 while the database answers; reports the Redis breaker

Without Kafka (no ``kafka_bootstrap`` / ``KAFKA_BOOTSTRAP``) a price change invalidates
directly with ``cache.invalidate`` and ``cache.invalidate_tag`` - the same effect, no
daemon needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import socket
import tomllib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from examples.bookstore.db import Database, open_database, parse_price
from examples.bookstore.models import BookDetail, CategoryPage, PriceUpdate, StockUpdate
from layered_cache import BookPriceChanged, Config, LayeredCache, encode_event, parse_config
from layered_cache.asgi import CachedResponses

# /metrics: the Prometheus exporter when the library ships one, else a JSON dump of
# cache.stats(). Decided once, at import, so a scrape never pays for the check.
_prometheus: Any
try:
    from layered_cache import prometheus as _prometheus

    if not hasattr(_prometheus, "register_cache") or not hasattr(_prometheus, "render_metrics"):
        _prometheus = None  # an older/other module of that name: use the JSON fallback
except ImportError:  # pragma: no cover - depends on the library version
    _prometheus = None

__all__ = [
    "DEFAULT_CONFIG",
    "MAX_BATCH",
    "METRICS_FORMAT",
    "PREFIX_MARKER",
    "BookNotFound",
    "BookstoreSettings",
    "CategoryNotFound",
    "book_tags",
    "claim_cache_prefix",
    "create_app",
    "load_bookstore_config",
    "serve",
]

DEFAULT_CONFIG = Path(__file__).with_name("bookstore.toml")
METRICS_FORMAT = "prometheus" if _prometheus is not None else "json"
_log = structlog.get_logger("bookstore")


MAX_BATCH = 100  # ids per GET /books?ids=...
_SLUG = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


class BookNotFound(LookupError):
    """Raised by the loader, so a missing book is a 404 and never a cached value.
    ``args``: the ids that don't exist (one, or several from a batch)."""


class CategoryNotFound(LookupError):
    """Raised by the category page's loader: an unknown slug is a 404, never cached."""


def book_tags(page: CategoryPage) -> list[str]:
    """A category page's tags: ``book:{id}`` for every book it shows (and prices)."""
    return [f"book:{b.id}" for b in page.books]


def load_bookstore_config(
    path: str | os.PathLike[str] | None = None,
    *,
    redis_url: str | None = None,
    prefix: str | None = None,
    kafka_bootstrap: str | None = None,
    topic: str | None = None,
    group_id: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """bookstore.toml (or ``path`` / ``$BOOKSTORE_CONFIG``) with the given overrides.

    ``REDIS_URL`` and ``KAFKA_BOOTSTRAP`` from ``env`` (default: the process env) fill
    the URLs when not passed; ``overrides`` merges keys into tables
    (``{"kafka": {"session_timeout": "2s"}}``); ``LAYERED_CACHE_*`` variables then apply
    as usual. Everything is validated like the file itself.
    """
    env = os.environ if env is None else env
    source = Path(path or env.get("BOOKSTORE_CONFIG") or DEFAULT_CONFIG)
    raw: dict[str, Any] = tomllib.loads(source.read_text())
    redis = raw.setdefault("redis", {})
    kafka = raw.setdefault("kafka", {})
    if redis_url or env.get("REDIS_URL"):
        redis["url"] = redis_url or env["REDIS_URL"]
    if prefix is not None:
        redis["prefix"] = prefix
    if kafka_bootstrap or env.get("KAFKA_BOOTSTRAP"):
        kafka["bootstrap_servers"] = kafka_bootstrap or env["KAFKA_BOOTSTRAP"]
    if topic is not None:
        kafka["topics"] = [topic]
        kafka["dead_letter_topic"] = f"{topic}.dlq"
    if group_id is not None:
        kafka["group_id"] = group_id
    for table, values in (overrides or {}).items():
        raw.setdefault(table, {}).update(values)
    return parse_config(raw, source=str(source), env=env)


@dataclass
class BookstoreSettings:
    """How to build one service instance.

    ``db``: share an already created database (the demo runs two instances on one
    SQLite); otherwise one is opened from ``database_url`` / ``$DATABASE_URL``.
    ``produce_events``: publish BookPriceChanged to Kafka (default: when a bootstrap is
    given or ``$KAFKA_BOOTSTRAP`` is set) instead of invalidating directly.
    """

    config: Config = field(default_factory=load_bookstore_config)
    db: Database | None = None
    database_url: str | None = None
    produce_events: bool | None = None
    name: str = "bookstore"

    @property
    def topic(self) -> str:
        return self.config.kafka.topics[0]

    def wants_kafka(self) -> bool:
        if self.produce_events is not None:
            return self.produce_events
        return bool(
            os.environ.get("KAFKA_BOOTSTRAP")
            or os.environ.get("LAYERED_CACHE_KAFKA_BOOTSTRAP_SERVERS")
        )


class _Service:
    """Per-instance state: the cache, the database, the producer and the cached reads."""

    def __init__(self, settings: BookstoreSettings) -> None:
        self.settings = settings
        self.db: Database = settings.db or open_database(settings.database_url)
        # The category page is read with get_or_load, not a decorator: declare its type
        # here so L2 hits decode into CategoryPage.
        self.cache = LayeredCache.from_config(
            settings.config, value_types={"category": CategoryPage}
        )
        self.producer: Any = None  # AIOKafkaProducer when events are produced
        # One registry per instance: two instances in one process (the demo) must not sum.
        self.registry: Any = None
        if _prometheus is not None:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry()

        # The decorator takes the key field ``id`` from the argument of the same name and
        # registers the return type, so L2 hits decode straight into BookDetail.
        @self.cache.cached("book")
        async def book_detail(id: int) -> BookDetail:
            return await self.load_book(id)

        self.book_detail = book_detail
        self.responses = CachedResponses(self.cache)

    async def load_book(self, book_id: int) -> BookDetail:
        """The loader of namespace "book": the database join."""
        detail = await self.db.book_detail(book_id)
        if detail is None:
            raise BookNotFound(book_id)
        return detail

    async def books(self, ids: Sequence[int]) -> list[BookDetail]:
        """Many books, in the order of ``ids``: L1, then one MGET for the rest, then one
        ``book_details`` query for every key still missing (``get_or_load_many``)."""

        async def load_many(missing: list[Mapping[str, object]]) -> list[BookDetail]:
            wanted = [int(str(fields["id"])) for fields in missing]
            found = await self.db.book_details(wanted)
            if unknown := [book_id for book_id in wanted if book_id not in found]:
                raise BookNotFound(*unknown)  # nothing of this batch's load is cached
            return [found[book_id] for book_id in wanted]

        unique = list(dict.fromkeys(ids))
        values = await self.cache.get_or_load_many("book", [{"id": i} for i in unique], load_many)
        by_id: dict[int, BookDetail] = dict(zip(unique, values, strict=True))
        return [by_id[book_id] for book_id in ids]

    async def load_category(self, slug: str) -> CategoryPage:
        """The category page from the database (the loader of namespace ``category``)."""
        page = await self.db.category_page(slug)
        if page is None:
            raise CategoryNotFound(slug)
        return page

    async def invalidate_book(self, book_id: int) -> None:
        """What a BookPriceChanged event does through the daemon, done here: the book's
        key and every entry tagged with the book (the category pages showing it)."""
        await self.cache.invalidate("book", {"id": book_id})
        await self.cache.invalidate_tag(f"book:{book_id}")

    async def start(self) -> None:
        await self.db.open()
        await self.cache.start()
        await claim_cache_prefix(self.settings.config, self.db.identity)
        if _prometheus is not None:
            _prometheus.register_cache(self.cache, self.registry)
        if self.settings.wants_kafka():
            from aiokafka import AIOKafkaProducer

            kafka = self.settings.config.kafka
            options: dict[str, Any] = {
                "bootstrap_servers": kafka.bootstrap_servers,
                "client_id": f"{self.settings.name}-producer",
                "security_protocol": kafka.security_protocol,
                "acks": "all",
            }
            if kafka.sasl_mechanism:
                options.update(
                    sasl_mechanism=kafka.sasl_mechanism,
                    sasl_plain_username=kafka.sasl_username,
                    sasl_plain_password=kafka.sasl_password,
                )
            self.producer = AIOKafkaProducer(**options)
            await self.producer.start()

    async def close(self) -> None:
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await self.producer.stop()
        if _prometheus is not None:
            _prometheus.unregister_cache(self.cache, self.registry)
        await self.cache.close()
        if self.settings.db is None:  # ours: close it; a shared one belongs to the caller
            await self.db.close()

    async def publish_price_change(self, book_id: int, old: str, new: str) -> str:
        """Tell the fleet. Kafka when configured; a failed send falls back to a direct
        invalidation (the DB is already updated: a lost event would leave the cache stale
        until its TTL; in production use an outbox table to make this exactly-once)."""
        if self.producer is None:
            await self.invalidate_book(book_id)
            return "direct"
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        event = BookPriceChanged(book_id=book_id, old_price=old, new_price=new, occurred_at=now)
        try:
            # Keyed by book: all events of one book land on one partition, in order.
            await self.producer.send_and_wait(
                self.settings.topic, encode_event(event), key=str(book_id).encode()
            )
        except Exception as exc:
            _log.warning("price_event_not_sent", book_id=book_id, error=str(exc))
            await self.invalidate_book(book_id)
            return "direct (kafka send failed)"
        return f"kafka:{self.settings.topic}"


PREFIX_MARKER = "bookstore:database"  # after the prefix: which database fills it


async def claim_cache_prefix(config: Config, identity: str) -> str | None:
    """Record that ``identity``'s database fills the cache under this Redis prefix, and
    warn when another one did: its cached books (prices!) would be served as this
    database's until they expire. Returns that other database, or None.

    One prefix serves one database: switching DATABASE_URL from SQLite to PostgreSQL
    on the same prefix would otherwise serve SQLite's cached prices. A marker key
    names the last database to start on the prefix; the warning says how to give each
    database its own prefix (the daemon must use the same one, so it isn't derived
    here behind the daemon's back). Best effort: Redis being down skips the check."""
    marker = f"{config.redis.prefix}{PREFIX_MARKER}"
    client = _redis_client(config)
    try:
        previous = await client.set(marker, identity, get=True)
    except Exception as exc:
        _log.info("cache_prefix_not_checked", error=f"{type(exc).__name__}: {exc}")
        return None
    finally:
        await client.aclose()
    other = previous.decode() if isinstance(previous, bytes) else previous
    if other is None or other == identity:
        return None
    _log.warning(
        "cache_prefix_shared_with_another_database",
        prefix=config.redis.prefix,
        cached_from=other,
        database=identity,
        consequence="books cached from the other database (prices included) are served "
        "until they expire (l2 ttl + stale.max_age)",
        fix="give each database its own prefix, the same for the service and the daemon: "
        f"LAYERED_CACHE_REDIS_PREFIX={config.redis.prefix or 'bookstore:'}<database>:",
    )
    return str(other)


def _redis_client(config: Config) -> Any:
    """A plain client for the marker, with the cache's connection settings."""
    import redis.asyncio as aioredis

    settings = config.redis
    options: dict[str, Any] = {
        "username": settings.username,
        "password": settings.password,
        "socket_timeout": max(settings.timeout, 1.0),
        "socket_connect_timeout": max(settings.connect_timeout, 1.0),
    }
    if settings.url.startswith("rediss://"):
        options.update(ssl_ca_certs=settings.ssl_ca_certs, ssl_certfile=settings.ssl_certfile,
                       ssl_keyfile=settings.ssl_keyfile)  # fmt: skip
    options = {key: value for key, value in options.items() if value is not None}
    if settings.cluster:
        return aioredis.RedisCluster.from_url(settings.url, **options)
    return aioredis.Redis.from_url(settings.url, **options)


# What no CachedResponses built (a batch of books, an error, the stats): no HTTP cache
# may keep it. Without a Cache-Control, a gateway keeps it a default TTL (Varnish: 120 s)
# out of reach of the purges, which find only X-Cache-Key (a price change showed on
# /books/8 at once and on /books?ids=8 two minutes later).
_NOT_STORED = {"Cache-Control": "no-store"}


def _json(data: Any, status: int = 200) -> Response:
    body = msgspec.json.encode(data)
    return Response(body, status_code=status, media_type="application/json", headers=_NOT_STORED)


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


async def _body(request: Request, typ: type[Any]) -> Any:
    try:
        return msgspec.json.decode(await request.body(), type=typ)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None


def _routes(svc: _Service) -> list[Route]:
    async def get_book(request: Request) -> Response:
        book_id: int = request.path_params["id"]
        try:
            # Cache-Control from the namespace's http policy, an ETag, and a 304 from
            # L1/L2 when the client (or the gateway) already has this version.
            return await svc.responses.respond(
                request, "book", {"id": book_id}, lambda: svc.load_book(book_id)
            )
        except BookNotFound:
            return _error(404, f"no book {book_id}")

    async def get_books(request: Request) -> Response:
        raw = request.query_params.get("ids", "")
        try:
            ids = [int(part) for part in raw.split(",")]
        except ValueError:
            return _error(422, f'ids must be book ids separated by commas, like "1,2,3", got {raw!r}')
        if not 1 <= len(ids) <= MAX_BATCH:
            return _error(422, f"ids: 1 to {MAX_BATCH} book ids, got {len(ids)}")
        try:
            return _json(await svc.books(ids))
        except BookNotFound as exc:
            return _error(404, "no book " + ", ".join(map(str, exc.args)))

    async def get_category(request: Request) -> Response:
        slug: str = request.path_params["slug"]
        if not _SLUG.fullmatch(slug):  # the cache key's character rules, and a sane URL
            return _error(404, f"no category {slug!r}")
        try:
            # Tagged with the books it shows (``book_tags``): ``invalidate_tag("book:42")``,
            # or a BookPriceChanged event through the daemon, kills every page showing 42,
            # in the cache and, through ``X-Cache-Tags``, in the gateway.
            return await svc.responses.respond(
                request, "category", {"slug": slug}, lambda: svc.load_category(slug),
                tags=book_tags,
            )
        except CategoryNotFound:
            return _error(404, f"no category {slug!r}")

    async def put_price(request: Request) -> Response:
        book_id: int = request.path_params["id"]
        try:
            cents = parse_price((await _body(request, PriceUpdate)).price)
        except ValueError as exc:
            return _error(422, str(exc))
        old = await svc.db.update_price(book_id, cents)
        if old is None:
            return _error(404, f"no book {book_id}")
        new = f"{cents // 100}.{cents % 100:02d}"
        via = await svc.publish_price_change(book_id, old, new)
        return _json({"book_id": book_id, "old_price": old, "new_price": new, "invalidation": via})

    async def get_stock(request: Request) -> Response:
        book_id: int = request.path_params["id"]
        # Namespace "stock" is cache = false: get_or_load calls the loader every time.
        stock = await svc.cache.get_or_load("stock", {"id": book_id}, lambda: svc.db.stock(book_id))
        if stock is None:
            return _error(404, f"no book {book_id}")
        reply = _json(stock)
        reply.headers["Cache-Control"] = svc.responses.cache_control("stock")  # no-store
        return reply

    async def put_stock(request: Request) -> Response:
        book_id: int = request.path_params["id"]
        try:
            update = await _body(request, StockUpdate)
        except ValueError as exc:
            return _error(422, str(exc))
        if update.on_hand < 0:
            return _error(422, "on_hand must be >= 0")
        if not await svc.db.set_stock(book_id, update.on_hand):
            return _error(404, f"no book {book_id}")
        return _json({"book_id": book_id, "on_hand": update.on_hand})

    async def metrics(request: Request) -> Response:
        if _prometheus is not None:
            body, content_type = _prometheus.render_metrics(svc.registry)
            return Response(body, headers={"Content-Type": content_type, **_NOT_STORED})
        return _json(_stats(svc))

    async def stats(request: Request) -> Response:
        return _json(_stats(svc))

    async def healthz(request: Request) -> Response:
        try:
            db_ok = await asyncio.wait_for(svc.db.ping(), 2.0)
        except Exception:
            db_ok = False
        breaker = svc.cache.redis_status().breaker
        body = {
            "status": "ok" if db_ok else "unavailable",
            "database": svc.db.kind if db_ok else "down",
            "redis_breaker": breaker,  # "open": Redis is skipped, reads go to the database
            "instance": svc.settings.name,
        }
        return _json(body, 200 if db_ok else 503)

    return [
        Route("/books", get_books, methods=["GET"]),
        Route("/books/{id:int}", get_book, methods=["GET"]),
        Route("/categories/{slug}", get_category, methods=["GET"]),
        Route("/books/{id:int}/price", put_price, methods=["PUT"]),
        Route("/books/{id:int}/stock", get_stock, methods=["GET"]),
        Route("/books/{id:int}/stock", put_stock, methods=["PUT"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]


def _stats(svc: _Service) -> dict[str, Any]:
    return {
        "instance": svc.settings.name,
        "metrics_format": METRICS_FORMAT,
        "cache": svc.cache.stats(),
        "redis": msgspec.to_builtins(svc.cache.redis_status()),
        "hot_keys": svc.cache.hot_keys(),
        "purge": msgspec.to_builtins(svc.cache.purge_stats()),  # HTTP caches, docs/http.md
        "db": {"kind": svc.db.kind, "queries": dict(svc.db.queries)},
    }


def create_app(settings: BookstoreSettings | None = None) -> Starlette:
    """One bookstore instance. The cache, DB and producer live for the app's lifespan."""
    settings = settings or BookstoreSettings()
    svc = _Service(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await svc.start()
        try:
            yield
        finally:
            await svc.close()

    app = Starlette(routes=_routes(svc), lifespan=lifespan)
    app.state.service = svc
    app.state.cache = svc.cache
    app.state.db = svc.db
    return app


@contextlib.asynccontextmanager
async def serve(app: Any, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Run ``app`` with uvicorn in this event loop; yields its base URL (``port=0``: a
    free port, bound before uvicorn starts, so there is no race for it)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises the startup error
                raise RuntimeError("uvicorn exited during startup")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        sock.close()

