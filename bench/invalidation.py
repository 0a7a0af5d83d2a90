"""Scenario 9: invalidation latency end to end, and the daemon's throughput.

Latency, what: ``BookPriceChanged`` events produced at 1,000/s (4 partitions); the
daemon (``layered_cache.daemon.Daemon``, in its own process, as ``layered-cache daemon``
runs it) deletes base key + 8 replicas + lease and appends the key to the backplane
stream. Measured per event:
- produced -> L2 keys gone: the backplane entry's ID is Redis' clock at the XADD, which
  the daemon issues right after the deletes, so this is a tight upper bound;
- produced -> L1 dropped in another instance: the time a separate ``LayeredCache``
  (its own process) runs its backplane callback for the key.
Throughput, what: N events produced up front, then a fresh daemon drains them; events/s
between its first and last backplane entry, for ``kafka.max_batch`` 1000 and 100
(batching amortises the Redis round trip, the XADD and the Kafka commit).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import uuid
from typing import Any

from bench.env import BenchEnv, unique_prefix
from bench.floors import median, percentile
from bench.plots import cdf
from bench.report import Headline, Section

ROUTES = [
    {"type": "BookPriceChanged", "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}]}
]
P99_TARGET = 0.100
THROUGHPUT_TARGET = 5000


def _config(redis_url: str, prefix: str, bootstrap: str, topic: str, max_batch: int) -> Any:
    from bench.configs import make_config

    kafka = {
        "bootstrap_servers": bootstrap,
        "topics": [topic],
        "group_id": f"bench-{uuid.uuid4().hex[:8]}",
        "dead_letter_topic": f"{topic}.dlq",
        "session_timeout": "2s",
        "heartbeat_interval": "200ms",
        "rebalance_timeout": "1s",
        "health_port": -1,
        "max_batch": max_batch,
    }
    return make_config(
        redis_url, prefix,
        {"book": {"key": "book:{id}", "l1": {"ttl": "10m", "max_entries": 100_000},
                  "hot": {"replicas": 8}}},
        kafka=kafka, events=ROUTES,
    )


# -- child processes ------------------------------------------------------------------------


def daemon_process(redis_url: str, prefix: str, bootstrap: str, topic: str, max_batch: int,
                   started: Any, stop: Any) -> None:
    """What ``layered-cache daemon --config FILE`` does, with the config built in code."""
    run_daemon(_config(redis_url, prefix, bootstrap, topic, max_batch), started, stop)


def run_daemon(config: Any, started: Any, stop: Any) -> None:
    """Run the daemon in this (child) process: ``started`` once it owns partitions,
    until ``stop``. Shared by the scenarios that measure event -> L1 latency."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    from layered_cache.daemon import Daemon

    async def main() -> None:
        daemon = Daemon(config, health_port=-1)
        task = asyncio.create_task(daemon.run())
        while not daemon.assignment and not task.done():
            await asyncio.sleep(0.05)
        started.set()
        while not stop.is_set() and not task.done():
            await asyncio.sleep(0.05)
        daemon.stop()
        await asyncio.wait_for(task, 20)

    asyncio.run(main())


def listener_process(redis_url: str, prefix: str, bootstrap: str, topic: str,
                     ready: Any, stop: Any, out: Any) -> None:
    """Another service instance: records when each key leaves its L1."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    from layered_cache import LayeredCache

    dropped: dict[str, float] = {}

    async def main() -> None:
        cache = LayeredCache.from_config(_config(redis_url, prefix, bootstrap, topic, 1000))
        assert cache._backplane is not None
        original = cache._backplane._on_keys

        def on_keys(keys: list[str]) -> None:
            now = time.time()
            for key in keys:
                dropped.setdefault(key, now)
            original(keys)

        cache._backplane._on_keys = on_keys  # observe the callback the backplane drives
        async with cache:
            await cache._backplane.connected.wait()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)

    asyncio.run(main())
    out.put(dropped)


# -- parent ---------------------------------------------------------------------------------


async def _stream_entries(redis_url: str, stream: str) -> list[tuple[float, list[str]]]:
    import msgspec
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = await client.xrange(stream)
    finally:
        await client.aclose()
    result = []
    for entry_id, fields in entries:
        if b"keys" not in fields:  # the stream's start marker: a listener's, no keys
            continue
        millis = int(entry_id.split(b"-")[0])
        result.append((millis / 1000, msgspec.msgpack.decode(fields[b"keys"])))
    return result


def _wait_event(event: Any, timeout: float) -> bool:
    return bool(event.wait(timeout))


async def _latency(env: BenchEnv, bootstrap: str, seconds: float) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer

    from layered_cache._event_types import BookPriceChanged, encode_event
    from tests.servers import create_topic

    url = env.redis_url()
    prefix = unique_prefix("inv")
    topic = f"bench-inv-{uuid.uuid4().hex[:6]}"
    await create_topic(bootstrap, topic, 4)
    ctx = mp.get_context("spawn")
    started, stop, ready, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    daemon = ctx.Process(target=daemon_process,
                         args=(url, prefix, bootstrap, topic, 1000, started, stop), daemon=True)
    listener = ctx.Process(target=listener_process,
                           args=(url, prefix, bootstrap, topic, ready, stop, out), daemon=True)
    daemon.start()
    listener.start()
    produced: dict[str, float] = {}
    try:
        if not await asyncio.to_thread(_wait_event, started, 60):
            raise RuntimeError("daemon got no partitions within 60 s")
        if not await asyncio.to_thread(_wait_event, ready, 30):
            raise RuntimeError("listener instance did not start")
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=1)
        await producer.start()
        try:
            rate, total = 1000, int(seconds * 1000)
            t0 = time.perf_counter()
            pending = []
            for i in range(total):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                event = encode_event(BookPriceChanged(i, "12.90", "9.90", "2026-11-29T10:00:00Z"))
                produced[f"{prefix}book:{i}"] = time.time()
                pending.append(await producer.send(topic, event, key=str(i).encode()))
            await asyncio.gather(*pending)
            achieved = total / (time.perf_counter() - t0)
        finally:
            await producer.stop()
        stream = prefix + "layered_cache:invalidations"
        deadline = time.monotonic() + 20
        gone: dict[str, float] = {}
        while time.monotonic() < deadline and len(gone) < len(produced):
            await asyncio.sleep(0.3)
            gone = {k: t for t, keys in await _stream_entries(url, stream) for k in keys}
    finally:
        stop.set()
        dropped: dict[str, float] = await asyncio.to_thread(out.get, True, 30)
        for proc in (daemon, listener):
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()
    l2 = [gone[k] - t for k, t in produced.items() if k in gone]
    l1 = [dropped[k] - t for k, t in produced.items() if k in dropped]
    return {"events": len(produced), "rate": achieved, "l2": l2, "l1": l1,
            "l2_missing": len(produced) - len(l2), "l1_missing": len(produced) - len(l1)}


async def _throughput(env: BenchEnv, bootstrap: str, events: int, max_batch: int) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer

    from layered_cache._event_types import BookPriceChanged, encode_event
    from tests.servers import create_topic

    url = env.redis_url()
    prefix = unique_prefix("thr")
    topic = f"bench-thr-{uuid.uuid4().hex[:6]}"
    await create_topic(bootstrap, topic, 4)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=262144)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, encode_event(
                BookPriceChanged(i, "12.90", "9.90", "2026-11-29T10:00:00Z")), key=str(i).encode())
            for i in range(events)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    ctx = mp.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=daemon_process,
                       args=(url, prefix, bootstrap, topic, max_batch, started, stop), daemon=True)
    proc.start()
    stream = prefix + "layered_cache:invalidations"
    try:
        if not await asyncio.to_thread(_wait_event, started, 60):
            raise RuntimeError("daemon got no partitions within 60 s")
        deadline = time.monotonic() + 120
        entries: list[tuple[float, list[str]]] = []
        while time.monotonic() < deadline:
            entries = await _stream_entries(url, stream)
            if sum(len(k) for _, k in entries) >= events:
                break
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.to_thread(proc.join, 30)
        if proc.is_alive():
            proc.kill()
    done = sum(len(k) for _, k in entries)
    if len(entries) < 2 or done < events:
        raise RuntimeError(f"daemon processed {done} of {events} events")
    span = entries[-1][0] - entries[0][0]
    counted = done - len(entries[0][1])
    return {"events": events, "max_batch": max_batch, "events_per_s": counted / span if span else 0.0,
            "stream_entries": len(entries), "keys_per_entry": done / len(entries)}


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("invalidation", "9. Invalidation latency (Kafka -> L2 -> L1) and daemon throughput")
    try:
        import layered_cache.daemon  # noqa: F401
    except ImportError as exc:
        section.error = f"the daemon is not available ({exc})"
        section.headline.append(Headline("Invalidation latency / daemon throughput", "n/a",
                                         "", "p99 <= 100 ms; >= 5,000 events/s", "n/a"))
        section.seconds = time.perf_counter() - started
        return section
    bootstrap = (await asyncio.to_thread(env.kafka)).bootstrap
    lat = await _latency(env, bootstrap, 2.0 if env.quick else 5.0)
    l2_p50, l2_p99 = percentile(lat["l2"], 50), percentile(lat["l2"], 99)
    l1_p50, l1_p99 = percentile(lat["l1"], 50), percentile(lat["l1"], 99)
    section.columns = ["measure", "p50", "p99", "max", "events"]
    section.rows = [
        ["event produced -> L2 keys gone (base + 8 replicas + lease)", f"{l2_p50 * 1000:.0f} ms",
         f"{l2_p99 * 1000:.0f} ms", f"{max(lat['l2']) * 1000:.0f} ms", f"{len(lat['l2']):,}"],
        ["event produced -> L1 dropped in another instance", f"{l1_p50 * 1000:.0f} ms",
         f"{l1_p99 * 1000:.0f} ms", f"{max(lat['l1']) * 1000:.0f} ms", f"{len(lat['l1']):,}"],
    ]
    section.notes.append(
        f"Produced at {lat['rate']:,.0f} events/s over 4 partitions; daemon and the other instance "
        f"each in their own process. Missing: L2 {lat['l2_missing']}, L1 {lat['l1_missing']}."
    )
    plot = cdf({"-> L2 keys gone": [x * 1000 for x in lat["l2"]],
                "-> L1 dropped (other instance)": [x * 1000 for x in lat["l1"]]},
               "Invalidation latency at 1,000 events/s", "ms after the event was produced",
               env.plot_path("invalidation_cdf.png"))
    throughput = []
    for max_batch in ((1000,) if env.quick else (1000, 100)):
        try:
            throughput.append(await _throughput(env, bootstrap, 5000 if env.quick else 20000, max_batch))
        except Exception as exc:
            section.notes.append(f"throughput with max_batch {max_batch}: n/a ({exc})")
    for t in throughput:
        section.rows.append([f"daemon throughput, max_batch {t['max_batch']} (8 replicas/key)",
                             f"{t['events_per_s']:,.0f} events/s", "", "",
                             f"{t['events']:,} ({t['keys_per_entry']:.0f} keys per batch)"])
    section.headline.append(Headline(
        "Invalidation at 1,000 events/s: event -> L2 gone / -> L1 dropped (p99)",
        f"{l2_p99 * 1000:.0f} ms / {l1_p99 * 1000:.0f} ms (p50 {l2_p50 * 1000:.0f} / {l1_p50 * 1000:.0f} ms)",
        "-", f"p99 <= {P99_TARGET * 1000:.0f} ms",
        "ok" if max(l2_p99, l1_p99) <= P99_TARGET and not lat["l2_missing"] else "MISSED",
    ))
    if throughput:
        best = max(t["events_per_s"] for t in throughput)
        section.headline.append(Headline(
            "Daemon throughput, 1 process, 8 replicas per key",
            f"{best:,.0f} events/s", "; ".join(f"max_batch {t['max_batch']}: {t['events_per_s']:,.0f}/s"
                                               for t in throughput),
            f">= {THROUGHPUT_TARGET:,}/s", "ok" if best >= THROUGHPUT_TARGET else "MISSED",
        ))
    section.data = {"latency": {k: v for k, v in lat.items()}, "throughput": throughput,
                    "plots": [plot],
                    "summary": {"l2_p50": l2_p50, "l2_p99": l2_p99, "l1_p50": l1_p50,
                                "l1_p99": l1_p99, "median_l2": median(lat["l2"])}}
    section.seconds = time.perf_counter() - started
    return section
