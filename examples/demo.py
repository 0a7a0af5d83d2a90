"""``make demo``: what layered_cache does, measured against real Redis and Kafka.

Part A - the read path (library only):
  A1  200 concurrent requests on a cold key: plain cache-aside vs layered_cache
  A2  where reads are served from (L1, L2) and what each costs
  A3  10,000 keys warmed at once: fixed TTL vs jittered TTL, the most expiries in 1 s

Part B - the bookstore service (examples/bookstore) with the invalidation daemon:
  B1  a stampede on a cold book across two instances -> 1 database query
  B2  a price change (DB -> Kafka -> daemon -> Redis -> backplane) visible within 1 s
  B3  a category page tagged with its books: a book's price change reaches it on both
      instances (the event's tag route kills every page showing the book)
  B4  GET /books?ids=...: many books in one call, one database query for the misses
  B5  stock (cache = false) is always live
  B6  the counters
  B7  (where varnishd is installed) Varnish in front of the service: a gateway hit, a
      304 for an unchanged book, a price change purged from the gateway at once

Env: REDIS_URL (default redis://127.0.0.1:6379/0), KAFKA_BOOTSTRAP (optional: without
it, B2 invalidates directly and the daemon is skipped). Every run uses its own key
prefix and topic, and removes its keys at the end. Exits non-zero if a claim fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import redis.asyncio as aioredis
import structlog

from examples.bookstore.app import BookstoreSettings, create_app, load_bookstore_config, serve
from examples.bookstore.db import SQLiteDatabase
from examples.gateway_demo import gateway_step
from layered_cache import Config, LayeredCache, parse_config

RUN = uuid.uuid4().hex[:6]
PREFIX = f"demo-{RUN}:"
WIDTH = 72
failures: list[str] = []


# -- output -----------------------------------------------------------------------------


def heading(text: str) -> None:
    print(f"\n{text}\n{'=' * len(text)}")


def step(text: str) -> None:
    print(f"\n{text}")


def row(label: str, value: str, note: str = "") -> None:
    line = f"  {label:<46}{value:>10}"
    print(f"{line}   {note}" if note else line)


def check(ok: bool, claim: str) -> str:
    if not ok:
        failures.append(claim)
    return "ok" if ok else "FAILED"


def n(value: float) -> str:
    return f"{value:,.0f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 0.001 else f"{seconds * 1000:,.2f} ms"


def delta(after: dict[str, Any], before: dict[str, Any]) -> Counter[str]:
    return Counter(
        {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int) and v != before.get(k, 0)}
    )


# -- Part A -----------------------------------------------------------------------------


class SlowDatabase:
    """Stands in for a 50 ms query and counts calls."""

    def __init__(self, delay: float = 0.05) -> None:
        self.delay = delay
        self.calls = 0

    async def load(self, key: str) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return {"id": key, "title": "The Invisible Library", "price": "12.90"}


def demo_config(redis_url: str) -> Config:
    book = {"key": "book:{id}", "l1": {"ttl": "30s"}, "l2": {"ttl": "10m"}}
    warm = {"key": "w:{id}", "l1": False, "l2": {"ttl": "10m", "jitter": 0.0}}
    return parse_config(
        {
            "redis": {"url": redis_url, "prefix": PREFIX, "timeout": "2s", "connect_timeout": "2s"},
            "namespaces": {
                "book": book,
                "fixed": warm,
                "jittered": {**warm, "key": "j:{id}", "l2": {"ttl": "10m", "jitter": 0.1}},
            },
        },
        source="<demo>",
        env={},
    )


async def part_a(redis_url: str) -> None:
    heading("Part A - the read path")
    config = demo_config(redis_url)

    step("A1. 200 concurrent requests for one cold key (the database takes 100 ms)")
    db = SlowDatabase(0.1)
    plain = aioredis.Redis.from_url(redis_url, max_connections=256)
    await asyncio.gather(*(plain.ping() for _ in range(200)))  # open the connections first

    async def cache_aside(key: str) -> Any:  # the textbook version: GET, miss -> query -> SET
        if (hit := await plain.get(key)) is not None:
            return hit
        value = await db.load(key)
        await plain.set(key, repr(value), ex=600)
        return value

    await asyncio.gather(*(cache_aside(f"{PREFIX}plain:42") for _ in range(200)))
    await plain.aclose()
    row("plain cache-aside (GET, miss -> query -> SET)", f"{n(db.calls)} calls", "every miss queries")

    db = SlowDatabase(0.1)
    caches = [LayeredCache.from_config(config) for _ in range(4)]
    async with contextlib.AsyncExitStack() as stack:
        for cache in caches:
            await stack.enter_async_context(cache)
        started = time.perf_counter()
        await asyncio.gather(
            *(
                caches[i % 4].get_or_load("book", {"id": 42}, lambda: db.load("42"))
                for i in range(200)
            )
        )
        elapsed = time.perf_counter() - started
        verdict = check(db.calls == 1, "A1: 200 requests -> 1 database call")
        row("layered_cache, 4 instances x 50 requests", f"{n(db.calls)} call", verdict)
        coalesced = sum(c.stats()["book"]["coalesced"] for c in caches)
        won = sum(c.stats()["book"]["lease_won"] for c in caches)
        waited = sum(c.stats()["book"]["lease_wait_filled"] for c in caches)
        print(
            f"    {coalesced} joined a load in their own process (single-flight), {won} instance"
            f" won the lease,\n    {waited} waited for its fill; all 200 answered in {ms(elapsed)}."
        )

        step("A2. Where reads are served from")
        reader = caches[1]
        before = reader.stats()["book"]
        started = time.perf_counter()
        for _ in range(1000):
            await reader.get_or_load("book", {"id": 42}, lambda: db.load("42"))
        per_read = (time.perf_counter() - started) / 1000
        d = delta(reader.stats()["book"], before)
        row("1,000 reads, warm instance", f"L1 {n(d['l1_hit'])}", f"{us(per_read)} per read")

        fresh = await stack.enter_async_context(LayeredCache.from_config(config))
        await fresh.get("book", {"id": 0})  # connect first: time the read, not the handshake
        before = fresh.stats()["book"]
        started = time.perf_counter()
        await fresh.get_or_load("book", {"id": 42}, lambda: db.load("42"))
        first = time.perf_counter() - started
        for _ in range(999):
            await fresh.get_or_load("book", {"id": 42}, lambda: db.load("42"))
        d = delta(fresh.stats()["book"], before)
        row("1,000 reads, new instance (cold L1): L2", f"L2 {n(d['l2_hit'])}", f"{us(first)} (Redis round trip)")
        row("                                     then L1", f"L1 {n(d['l1_hit'])}", "")
        verdict = check(db.calls == 1 and d["l2_hit"] == 1, "A2: L2 then L1, no loads")
        row("database calls for all 2,000 reads", f"{n(db.calls - 1)}", verdict)

        step("A3. 10,000 keys filled at once (a cold start), L2 ttl 10 m; expiries read back from Redis")
        print(f"  {'':<30}{'most expiries in 1 s':>24}{'expiries spread over':>22}")
        for namespace, label in (("fixed", "fixed TTL (jitter 0)"), ("jittered", "jitter 0.1 (10 m +- 60 s)")):
            busiest, spread = await warm(caches[0], namespace, 10_000)
            print(f"  {label:<30}{n(busiest) + ' keys':>24}{f'{spread:,.0f} s':>22}")
            if namespace == "fixed":
                fixed_busiest = busiest
        check(busiest * 5 < fixed_busiest, "A3: jitter flattens the expiry peak")
        print("  Without jitter, keys filled together expire together: a reload storm 10 minutes")
        print("  later. Every TTL in layered_cache (L1, L2, replicas) is drawn from ttl * (1 +- jitter).")


async def warm(cache: LayeredCache, namespace: str, count: int) -> tuple[int, float]:
    """Fill ``count`` keys the way a cold start does (all within a second or two) and
    return (most expiries within 1 s, seconds between first and last expiry).

    Each key gets the TTL the namespace's policy draws for every fill and set
    (``policy.l2_ttl_draw()``: ttl * (1 +- jitter)) and the same envelope; the writes go
    out in pipelines of 1,000 so warming 10,000 keys takes well under a second. The
    expiries are then read back from Redis (PTTL), not computed.
    """
    policy = cache.namespace(namespace).policy
    client = aioredis.Redis.from_url(cache.config.redis.url)
    try:
        for start in range(0, count, 1000):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + 1000, count)):
                now = time.time()
                soft_expiry = now + policy.l2_ttl_draw()
                data = policy.codec.encode({"id": i, "v": "x" * 32}, now, soft_expiry, 0.0)
                pipe.set(cache.key(namespace, {"id": i}), data, px=int((soft_expiry - now) * 1000))
            await pipe.execute()
        now_ms = time.time() * 1000
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            pipe.pttl(cache.key(namespace, {"id": i}))
        ttls = await pipe.execute()
    finally:
        await client.aclose()
    return busiest_second([now_ms + ttl for ttl in ttls if ttl > 0])


def busiest_second(expiries_ms: list[float]) -> tuple[int, float]:
    """(the most expiries within any 1 s window, seconds from the first to the last).

    A sliding window, not calendar seconds: keys filled within 0.3 s would otherwise
    show as 10,000 or as 6,000 + 4,000, depending on where a second boundary fell."""
    times = sorted(expiries_ms)
    busiest, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= 1000:
            first += 1
        busiest = max(busiest, last - first + 1)
    return busiest, max(1.0, math.ceil((times[-1] - times[0]) / 1000))


# -- Part B -----------------------------------------------------------------------------


async def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


async def wait_for(predicate: Callable[[], Awaitable[bool] | bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result or time.monotonic() > deadline:
            return bool(result)
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def invalidation_daemon(config: Config) -> Any:
    """The daemon in this process (``layered_cache.daemon.Daemon``), ready once it owns partitions."""
    from layered_cache.daemon import Daemon

    daemon = Daemon(config, health_port=0)
    task = asyncio.ensure_future(daemon.run())
    try:
        ready = await wait_for(lambda: task.done() or bool(daemon.assignment), 20.0)
        if task.done():
            task.result()
        if not ready:
            raise RuntimeError("the invalidation daemon got no partitions within 20 s")
        yield daemon
    finally:
        daemon.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


def quiet_logs() -> None:
    """The demo prints its own story: library, daemon and client logs at warning+ only."""
    logging.basicConfig(level=logging.WARNING, format="  (log) %(name)s: %(message)s")
    for name in ("aiokafka", "kafka", "uvicorn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


async def part_b(redis_url: str, bootstrap: str | None) -> None:
    heading("Part B - the bookstore service")
    topic = f"demo-catalog-{RUN}"
    config = load_bookstore_config(
        redis_url=redis_url,
        prefix=PREFIX + "shop:",
        kafka_bootstrap=bootstrap or "127.0.0.1:9",
        topic=topic,
        group_id=f"demo-invalidator-{RUN}",
        # Short group timings: the demo's consumer group forms in about a second.
        overrides={
            "kafka": {"session_timeout": "2s", "heartbeat_interval": "200ms", "rebalance_timeout": "1s"},
            "logging": {"level": "error"},
        },
        env={},
    )
    # One database shared by two service instances, 50 ms per book query (a loaded DB).
    db = SQLiteDatabase(":memory:", books=1000, query_delay=0.05)
    await db.open()
    kafka = bootstrap is not None
    print(f"  database: SQLite, 1,000 books; two instances (A, B) of the service; topic {topic}")
    if not kafka:
        print("  note: KAFKA_BOOTSTRAP not set - no daemon; a price change invalidates directly")

    async with contextlib.AsyncExitStack() as stack:
        daemon = None
        if kafka:
            assert bootstrap is not None
            await create_topic(bootstrap, topic, partitions=2)
            started = time.perf_counter()
            daemon = await stack.enter_async_context(invalidation_daemon(config))
            print(
                f"  invalidation daemon: consuming {topic} (partitions"
                f" {sorted(tp.partition for tp in daemon.assignment)}), ready in"
                f" {ms(time.perf_counter() - started)}"
            )
        apps = {}
        for name in ("A", "B"):
            app = create_app(BookstoreSettings(config=config, db=db, produce_events=kafka, name=name))
            base = await stack.enter_async_context(serve(app))
            apps[name] = (app, await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=10)))
            print(f"  instance {name}: {base}")
        a, b = apps["A"][1], apps["B"][1]
        book = 42

        step(f"B1. Stampede: 100 concurrent GET /books/{book} on a cold key (50 to A, 50 to B)")
        before = db.queries["book_detail"]
        started = time.perf_counter()
        replies = await asyncio.gather(*(c.get(f"/books/{book}") for c in [a, b] * 50))
        elapsed = time.perf_counter() - started
        queries = db.queries["book_detail"] - before
        statuses = Counter(r.status_code for r in replies)
        detail = replies[0].json()
        row("responses", f"{n(statuses[200])} x 200", f"in {ms(elapsed)}")
        row("database queries (the 4-table join)", n(queries), check(queries == 1, "B1: 1 query"))
        print(f"    {detail['title']!r} by {detail['author']}, {detail['price']} {detail['currency']},"
              f" {detail['review_count']} reviews")

        step(f"B2. Price change: PUT /books/{book}/price on instance A")
        old_price = detail["price"]
        new_price = "9.90" if old_price != "9.90" else "8.90"
        for client in (a, b):  # both instances hold the old price in L1
            assert (await client.get(f"/books/{book}")).json()["price"] == old_price
        started = time.perf_counter()
        reply = (await a.put(f"/books/{book}/price", json={"price": new_price})).json()
        put_done = time.perf_counter() - started
        row(f"{old_price} -> {new_price}: DB updated; invalidation via", reply["invalidation"], f"{ms(put_done)}")
        seen: dict[str, float] = {}

        async def watch(name: str, client: httpx.AsyncClient) -> None:
            while time.perf_counter() - started < 5:
                if (await client.get(f"/books/{book}")).json()["price"] == new_price:
                    seen[name] = time.perf_counter() - started
                    return
                await asyncio.sleep(0.005)

        await asyncio.gather(watch("A", a), watch("B", b))
        for name in ("A", "B"):
            took = seen.get(name)
            verdict = check(took is not None and took < 1.0, f"B2: instance {name} sees the price < 1 s")
            row(f"readers on instance {name} see {new_price} after", ms(took) if took else "never", verdict)
        if daemon is not None:
            print("    path: Kafka -> daemon deletes book:42 (+ replicas, lease) in Redis -> backplane")
            print("          stream -> both instances drop their L1 copy -> next read loads the new price")

        await category_page_step(a, b, db, kafka)
        await batch_step(a, db)

        step("B5. Stock is never cached (namespace stock: cache = false)")
        before = db.queries["stock"]
        on_hand = (await a.get(f"/books/{book}/stock")).json()["on_hand"]
        live = True
        for sold in range(1, 4):
            await b.put(f"/books/{book}/stock", json={"on_hand": on_hand - sold})  # a sale on B
            live &= (await a.get(f"/books/{book}/stock")).json()["on_hand"] == on_hand - sold
        reads = 4
        queries = db.queries["stock"] - before
        row(f"3 sales on B, read at once on A: {on_hand} -> {on_hand - 3}", "live" if live else "STALE",
            check(live, "B3: stock is live"))
        row(f"{reads} stock reads -> database queries", n(queries), check(queries == reads, "B3: no caching"))

        step("B6. Counters (GET /stats on each instance; the same numbers are on /metrics)")
        stats = {name: (await c.get("/stats")).json() for name, (_, c) in apps.items()}
        fields = ["l1_hit", "l2_hit", "miss", "load", "coalesced", "lease_won", "lease_lost",
                  "lease_wait_filled", "invalidated", "backplane_l1_dropped"]
        print(f"  {'namespace book':<22}" + "".join(f"{name:>10}" for name in stats))
        for field in fields:
            print(f"  {field:<22}" + "".join(f"{n(s['cache']['book'][field]):>10}" for s in stats.values()))
        for field in ("load", "l1_hit", "l2_hit"):
            print(f"  {'category: ' + field:<22}"
                  + "".join(f"{n(s['cache']['category'][field]):>10}" for s in stats.values()))
        print(f"  {'stock: load (live)':<22}" + "".join(f"{n(s['cache']['stock']['load']):>10}" for s in stats.values()))
        print(f"  {'breaker':<22}" + "".join(f"{s['redis']['breaker']:>10}" for s in stats.values()))
        print(f"  database queries (shared): {dict(db.queries)}")
        print("    book_detail: the stampede's one fill + one reload after the price change;"
              " category_page:\n    one fill + one reload of the page showing the book;"
              " book_details: the batch's misses; stock: every read")
        print("    coalesced: joined a load in flight in the same process; lease_lost /"
              " lease_wait_filled:\n    waited for the other instance's fill instead of querying")
        print("    invalidated: this instance's invalidate() calls; backplane_l1_dropped: L1 copies"
              " it dropped\n    for invalidations by the daemon or another instance")
        if daemon is not None:
            st = daemon.stats
            print(f"  daemon: {st.events} event(s), {st.keys} key(s) and {st.tags_invalidated} tag(s)"
                  f" invalidated, {st.names_deleted} Redis name(s) deleted, {st.commits} commit(s),"
                  f" {st.dead_letters} dead letter(s)")
        metrics = await a.get("/metrics")
        kind = metrics.headers.get("content-type", "").split(";")[0]
        print(f"  GET /metrics on A: {len(metrics.text.splitlines())} lines of {kind}")
        await gateway_step(config, db, row, check, ms)  # skipped without varnishd
    await db.close()


async def category_page_step(
    a: httpx.AsyncClient, b: httpx.AsyncClient, db: SQLiteDatabase, kafka: bool
) -> None:
    slug = "scifi"
    step(f"B3. Category page: GET /categories/{slug}, tagged book:<id> for each book it shows")
    before = db.queries["category_page"]
    pages = await asyncio.gather(*(c.get(f"/categories/{slug}") for c in [a, b] * 10))
    page = pages[0].json()
    queries = db.queries["category_page"] - before
    row("20 reads (10 on A, 10 on B) -> database queries", n(queries),
        check(queries == 1, "B3: one category page query"))  # fmt: skip
    print(f"    {page['name']!r}: {page['book_count']} books, the first {len(page['books'])}"
          f" on the page (and in its tags)")  # fmt: skip
    shown = next(book for book in page["books"] if book["id"] != 42)  # not B2's book
    book, old_price = shown["id"], shown["price"]
    new_price = "4.90" if old_price != "4.90" else "5.90"

    async def price_on_page(client: httpx.AsyncClient) -> str:
        reply = (await client.get(f"/categories/{slug}")).json()
        return str(next(b["price"] for b in reply["books"] if b["id"] == book))

    print(f"    book {book} {shown['title']!r} on the page")
    prices = [await price_on_page(c) for c in (a, b)]
    row("price on the page before", f"A {prices[0]}", f"B {prices[1]}")
    started = time.perf_counter()
    reply = (await b.put(f"/books/{book}/price", json={"price": new_price})).json()
    row(f"PUT {old_price} -> {new_price} on B; invalidation via", reply["invalidation"],
        ms(time.perf_counter() - started))  # fmt: skip
    seen: dict[str, float] = {}

    async def watch(name: str, client: httpx.AsyncClient) -> None:
        while time.perf_counter() - started < 5:
            if await price_on_page(client) == new_price:
                seen[name] = time.perf_counter() - started
                return
            await asyncio.sleep(0.005)

    await asyncio.gather(watch("A", a), watch("B", b))
    prices = [await price_on_page(c) for c in (a, b)]
    row("price on the page after", f"A {prices[0]}", f"B {prices[1]}")
    for name in ("A", "B"):
        took = seen.get(name)
        verdict = check(took is not None and took < 1.0, f"B3: page on {name} shows the price < 1 s")
        row(f"the page on instance {name} shows {new_price} after", ms(took) if took else "never", verdict)
    if kafka:
        print(f"    path: BookPriceChanged -> daemon: DEL book:{book}, new version of tag book:{book}"
              "\n          (route in bookstore.toml) -> backplane -> both instances drop the page"
              " -> one reload")  # fmt: skip
    else:
        print(f"    path: the service calls invalidate('book', ...) and invalidate_tag('book:{book}')")


async def batch_step(a: httpx.AsyncClient, db: SQLiteDatabase) -> None:
    ids = [42, 7, 8, 9, 42]
    step(f"B4. Many books at once: GET /books?ids={','.join(map(str, ids))} on A")
    before = Counter(db.queries)
    books = (await a.get("/books", params={"ids": ",".join(map(str, ids))})).json()
    in_order = [book["id"] for book in books] == ids
    row("books returned, in the order asked", f"{len(books)}", check(in_order, "B4: in order"))
    queries = db.queries["book_details"] - before["book_details"]
    singles = db.queries["book_detail"] - before["book_detail"]
    row("database queries for the 3 misses (42: cached)", n(queries + singles),
        check(queries == 1 and singles == 0, "B4: one query for the misses"))  # fmt: skip
    again = Counter(db.queries)
    await a.get("/books", params={"ids": ",".join(map(str, ids))})
    row("the same request again -> database queries", n(sum((Counter(db.queries) - again).values())), "")


# -- main -------------------------------------------------------------------------------


async def cleanup(redis_url: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    removed = 0
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{PREFIX}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += await client.unlink(*batch)
                batch.clear()
        if batch:
            removed += await client.unlink(*batch)
    finally:
        await client.aclose()
    return removed


async def main() -> int:
    quiet_logs()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP") or None
    started = time.perf_counter()
    print(f"layered_cache demo - redis {redis_url}, kafka {bootstrap or '(none)'}, prefix {PREFIX}")
    probe = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2)
    try:
        await probe.ping()
    except Exception as exc:
        print(f"Redis at {redis_url} is not reachable ({exc}); run `make services-up` first.")
        return 1
    finally:
        await probe.aclose()
    try:
        await part_a(redis_url)
        await part_b(redis_url, bootstrap)
    finally:
        removed = await cleanup(redis_url)
    print(f"\nDone in {time.perf_counter() - started:.1f} s; removed {removed:,} demo keys.")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


def run() -> None:
    sys.exit(asyncio.run(main()))


if __name__ == "__main__":
    run()
