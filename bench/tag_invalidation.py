"""Scenario 13: a tag invalidation until the list page is gone from every instance's L1.

What: two cache instances (A and B, one process, one event loop, backplane on, loopback
Redis) each hold a category page tagged ``book:<id>`` in L1 (filled with
``get_or_load(..., tags=)``: A loads, B reads L2). Then the tag is invalidated and both
L1s are polled (``cache.namespace("category").policy.l1.get(key)`` returning
``layered_cache._l1.MISSING``, every loop iteration) until the page is gone from both.
Two ways to invalidate, 200 rounds each, a fresh page and tag per round:
- ``A.invalidate_tag("book:<id>")``: from the call to gone in A (at once) and in B (the
  backplane);
- a ``BookPriceChanged`` event produced to Kafka, routed by ``{ tag = "book:{book_id}" }``
  to a daemon in its own process (as ``layered-cache daemon`` runs it): from
  ``send`` to gone in both.
Why: the freshness promise for derived entries; p99 <= 100 ms on loopback.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import percentile
from bench.invalidation import run_daemon
from bench.report import Headline, Section
from bench.sends import drop_prefix
from layered_cache import LayeredCache
from layered_cache._l1 import MISSING

P99_TARGET = 0.100
WARMUP = 5
DEADLINE = 5.0
NAMESPACES: dict[str, dict[str, Any]] = {
    "book": {"key": "book:{id}"},
    "category": {"key": "category:{slug}", "tags": True,
                 "l1": {"ttl": "10m", "max_entries": 10_000}},
}
ROUTES = [{"type": "BookPriceChanged",
           "invalidate": [{"namespace": "book", "key": {"id": "book_id"}},
                          {"tag": "book:{book_id}"}]}]


def _config(redis_url: str, prefix: str, bootstrap: str | None = None,
            topic: str | None = None) -> Any:
    if bootstrap is None:
        return make_config(redis_url, prefix, NAMESPACES)
    kafka = {
        "bootstrap_servers": bootstrap, "topics": [topic],
        "group_id": f"bench-{uuid.uuid4().hex[:8]}", "dead_letter_topic": f"{topic}.dlq",
        "session_timeout": "2s", "heartbeat_interval": "200ms", "rebalance_timeout": "1s",
        "health_port": -1, "max_batch": 1000,
    }
    return make_config(redis_url, prefix, NAMESPACES, kafka=kafka, events=ROUTES)


def daemon_process(redis_url: str, prefix: str, bootstrap: str, topic: str,
                   started: Any, stop: Any) -> None:
    """What ``layered-cache daemon --config FILE`` does, with the tag route."""
    run_daemon(_config(redis_url, prefix, bootstrap, topic), started, stop)


class Pair:
    """Instances A and B holding page ``r`` (tagged ``book:<r>``) in L1."""

    def __init__(self, a: LayeredCache, b: LayeredCache) -> None:
        self.a, self.b = a, b
        self.l1s = [c.namespace("category").policy.l1 for c in (a, b)]

    async def fill(self, r: int) -> str:
        page = {"slug": f"page-{r}", "books": [r, 7], "title": f"Category {r}"}

        async def load() -> Any:
            return page

        fields = {"slug": f"page-{r}"}
        for cache in (self.a, self.b):
            await cache.get_or_load("category", fields, load, tags=[f"book:{r}"])
        key = self.a.key("category", fields)
        assert all(l1 is not None and l1.get(key) is not MISSING for l1 in self.l1s)
        return key

    async def gone(self, key: str, t0: float) -> list[float]:
        """Seconds from ``t0`` until ``key`` left A's L1 and B's L1."""
        when: list[float | None] = [None, None]
        deadline = t0 + DEADLINE
        while None in when:
            now = time.perf_counter()
            for i, l1 in enumerate(self.l1s):
                if when[i] is None and l1 is not None and l1.get(key) is MISSING:
                    when[i] = now - t0
            if now > deadline:
                raise RuntimeError(f"the page is still in an L1 after {DEADLINE:.0f} s: {when}")
            await asyncio.sleep(0)
        return [w for w in when if w is not None]


async def _direct(env: BenchEnv, rounds: int) -> list[list[float]]:
    url = env.redis_url()
    prefix = unique_prefix("tagl1")
    config = _config(url, prefix)
    results: list[list[float]] = []
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        pair = Pair(a, b)
        for r in range(rounds + WARMUP):
            key = await pair.fill(r)
            t0 = time.perf_counter()
            await a.invalidate_tag(f"book:{r}")
            times = await pair.gone(key, t0)
            if r >= WARMUP:
                results.append(times)
    raw = aioredis.Redis.from_url(url)
    await drop_prefix(raw, prefix)
    await raw.aclose()
    return results


def _wait(event: Any, timeout: float) -> bool:
    return bool(event.wait(timeout))


async def _kafka(env: BenchEnv, rounds: int) -> list[list[float]]:
    from aiokafka import AIOKafkaProducer

    from layered_cache._event_types import BookPriceChanged, encode_event
    from tests.servers import create_topic

    bootstrap = (await asyncio.to_thread(env.kafka)).bootstrap
    url = env.redis_url()
    prefix = unique_prefix("tagk")
    topic = f"bench-tag-{uuid.uuid4().hex[:6]}"
    await create_topic(bootstrap, topic, 1)
    ctx = mp.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    daemon = ctx.Process(target=daemon_process, args=(url, prefix, bootstrap, topic, started, stop),
                         daemon=True)
    daemon.start()
    results: list[list[float]] = []
    config = _config(url, prefix, bootstrap, topic)
    try:
        if not await asyncio.to_thread(_wait, started, 60):
            raise RuntimeError("daemon got no partitions within 60 s")
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
        await producer.start()
        try:
            async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
                pair = Pair(a, b)
                for r in range(rounds + WARMUP):
                    key = await pair.fill(r)
                    event = encode_event(BookPriceChanged(r, "12.90", "9.90", "2026-12-01T19:00:00Z"))
                    t0 = time.perf_counter()
                    await producer.send(topic, event, key=str(r).encode())
                    times = await pair.gone(key, t0)
                    if r >= WARMUP:
                        results.append(times)
        finally:
            await producer.stop()
    finally:
        stop.set()
        await asyncio.to_thread(daemon.join, 20)
        if daemon.is_alive():
            daemon.kill()
    raw = aioredis.Redis.from_url(url)
    await drop_prefix(raw, prefix)
    await raw.aclose()
    return results


def _row(label: str, results: list[list[float]]) -> tuple[list[str], dict[str, float]]:
    both = [max(r) for r in results]
    a, b = [r[0] for r in results], [r[1] for r in results]
    s = {"p50": percentile(both, 50), "p99": percentile(both, 99), "max": max(both),
         "a_p50": percentile(a, 50), "a_p99": percentile(a, 99),
         "b_p50": percentile(b, 50), "b_p99": percentile(b, 99)}

    def ms(x: float) -> str:
        return f"{x * 1000:.1f} ms"

    return [label, ms(s["p50"]), ms(s["p99"]), ms(s["max"]),
            f"{ms(s['a_p50'])} / {ms(s['a_p99'])}", f"{ms(s['b_p50'])} / {ms(s['b_p99'])}",
            str(len(results))], s


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("tag_invalidation",
                      "13. Tag invalidation -> the tagged page gone from every instance's L1")
    rounds = 50 if env.quick else 200
    section.columns = ["invalidation", "p50 (gone from both)", "p99", "max",
                       "A's L1 p50 / p99", "B's L1 p50 / p99", "rounds"]
    summary: dict[str, dict[str, float]] = {}
    raw: dict[str, Any] = {}
    direct = await _direct(env, rounds)
    row, summary["invalidate_tag"] = _row("A.invalidate_tag(tag)", direct)
    section.rows.append(row)
    raw["invalidate_tag"] = direct
    try:
        import layered_cache.daemon  # noqa: F401

        kafka = await _kafka(env, rounds)
        row, summary["kafka"] = _row("BookPriceChanged -> Kafka -> daemon (route { tag = ... })",
                                     kafka)
        section.rows.append(row)
        raw["kafka"] = kafka
    except Exception as exc:
        section.notes.append(f"Kafka route: n/a ({type(exc).__name__}: {exc})")
    section.notes.append(
        f"{rounds} rounds per way after {WARMUP} warm-up rounds; a fresh page and tag per round; "
        "A and B share one process and event loop (B's backplane reader competes with the "
        "polling), the daemon has its own process. Times from the invalidate_tag call / the "
        "producer's send."
    )
    for name, s in summary.items():
        label = ("invalidate_tag -> page gone from both L1s (p99)" if name == "invalidate_tag"
                 else "BookPriceChanged (Kafka, tag route) -> page gone from both L1s (p99)")
        section.headline.append(Headline(
            label, f"{s['p99'] * 1000:.1f} ms (p50 {s['p50'] * 1000:.1f} ms)",
            "-", f"p99 <= {P99_TARGET * 1000:.0f} ms", "ok" if s["p99"] <= P99_TARGET else "MISSED",
        ))
    section.data = {"summary": summary, "rounds_s": raw}
    section.seconds = time.perf_counter() - started
    return section
