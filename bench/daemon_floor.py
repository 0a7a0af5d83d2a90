"""Scenario 9b: the daemon's throughput in one process against a floor measured beside it.

What: N ``BookPriceChanged`` events (default 20,000; 5,000 with ``--quick``) are produced
once to a fresh 4-partition topic. Then, in the same process, 7 rounds (3 with
``--quick``) alternate the two contenders, ABBA (floor, daemon; daemon, floor; ...), each
draining the whole topic from the start under a fresh consumer group; the figure is
events/s from the first non-empty ``getmany`` to the end of the batch that completes the
N-th event. Median of the rounds, and the ratio daemon / floor of the medians (the
median of per-round ratios and the process CPU per 1,000 events are reported beside).

- **floor**: an ``AIOKafkaConsumer`` with the daemon's own consumer settings
  (``daemon.kafka.consumer_kwargs``: ``max_poll_records`` 1000, ``fetch_max_wait_ms``...)
  doing ``getmany`` and, per batch, one DEL of exactly the names the daemon deletes for
  those events (base key, its lease, 8 replicas and their 8 leases: 18 names per event),
  looked up by (partition, offset) from a table built before the clock starts, as bytes.
  No JSON decoding, no backplane append, no commit: only what no daemon can avoid.
- **daemon**: ``layered_cache.daemon.Daemon`` as ``layered-cache daemon`` runs it (its
  ``run()`` loop, unmodified): decode and validate each event, route it to keys, the
  two-phase delete (one atomic DEL on a single node), the backplane XADD, the commit.
  Only ``_handle`` is wrapped, to read the clock around each batch.

Both use the library's Redis client (``make_client``) against the same Redis; the names
do not exist (DEL of missing names), so Redis' share is as small as it gets and the
ratio shows the Python work on top of the floor.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from bench.env import BenchEnv, unique_prefix
from bench.floors import median
from bench.report import Headline, Section

PARTITIONS = 4
REPLICAS = 8
RATIO_TARGET = 0.8
ROUTES = [
    {"type": "BookPriceChanged", "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}]}
]


def _config(redis_url: str, prefix: str, bootstrap: str, topic: str) -> Any:
    from bench.configs import make_config

    kafka = {
        "bootstrap_servers": bootstrap,
        "topics": [topic],
        "group_id": f"bench-daemon-{uuid.uuid4().hex[:8]}",  # fresh per round: from offset 0
        "dead_letter_topic": f"{topic}.dlq",
        "session_timeout": "2s",
        "heartbeat_interval": "200ms",
        "rebalance_timeout": "1s",
        "health_port": -1,
        "max_batch": 1000,
    }
    return make_config(
        redis_url, prefix,
        {"book": {"key": "book:{id}", "l1": {"ttl": "10m"}, "hot": {"replicas": REPLICAS}}},
        kafka=kafka, events=ROUTES,
    )


def _names(prefix: str, book_id: int) -> list[bytes]:
    """The daemon's names for one key, built here independently of the library;
    ``_check_names`` makes sure the daemon's ``Deleter`` removes exactly these."""
    key = f"{prefix}book:{book_id}"
    names = [key, "{" + key + "}:lease"]
    for i in range(REPLICAS):
        names += [f"{key}#{i}", "{" + f"{key}#{i}" + "}:lease"]
    return [name.encode() for name in names]


async def _produce(bootstrap: str, topic: str, events: int, prefix: str) -> dict[tuple[int, int], list[bytes]]:
    """Produce the events; returns (partition, offset) -> the names the event invalidates."""
    from aiokafka import AIOKafkaProducer

    from layered_cache._event_types import BookPriceChanged, encode_event
    from tests.servers import create_topic

    await create_topic(bootstrap, topic, PARTITIONS)
    await create_topic(bootstrap, f"{topic}.dlq", 1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=262144)
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic,
                encode_event(BookPriceChanged(i, "12.90", "9.90", "2026-11-29T10:00:00Z")),
                key=str(i).encode(),
                partition=i % PARTITIONS,
            )
            for i in range(events)
        ]
        sent = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return {(meta.partition, meta.offset): _names(prefix, i) for i, meta in enumerate(sent)}


async def _floor(config: Any, names: Mapping[tuple[int, int], Sequence[bytes]]) -> dict[str, float]:
    """getmany + one DEL of the batch's precomputed names; nothing else."""
    from aiokafka import AIOKafkaConsumer

    from layered_cache._clients import make_client
    from layered_cache.daemon.kafka import consumer_kwargs

    events = len(names)
    client = make_client(config.redis)
    consumer = AIOKafkaConsumer(**consumer_kwargs(config.kafka))
    consumer.subscribe(config.kafka.topics)
    await consumer.start()
    try:
        await client.ping()  # connect before the clock starts, as the daemon has
        done, started, cpu, batches = 0, 0.0, 0.0, 0
        deadline = time.monotonic() + 120
        while done < events and time.monotonic() < deadline:
            records = await consumer.getmany(timeout_ms=200, max_records=config.kafka.max_batch)
            if not records:
                continue
            if not started:
                started, cpu = time.perf_counter(), time.process_time()
            batch: list[bytes] = []
            for tp, messages in records.items():
                partition = tp.partition
                for message in messages:
                    batch += names[partition, message.offset]
                done += len(messages)
            await client.delete(*batch)
            batches += 1
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
    finally:
        await consumer.stop()
        await client.aclose()
    if done < events:
        raise RuntimeError(f"floor consumed {done} of {events} events")
    return {"events_per_s": events / elapsed, "seconds": elapsed, "batches": batches,
            "cpu_ms_per_1000": cpu * 1000 / (events / 1000)}


async def _daemon(config: Any, events: int) -> dict[str, float]:
    """The real daemon loop; the clock runs from the start of its first batch to the
    end of the batch that completes ``events`` (deletes, backplane, commit all done)."""
    from layered_cache.daemon import Daemon

    daemon = Daemon(config, health_port=-1)
    handle = daemon._handle
    clock: dict[str, float] = {}

    async def timed(records: Any) -> None:
        if "start" not in clock:
            clock["start"], clock["cpu_start"] = time.perf_counter(), time.process_time()
        await handle(records)
        if daemon.stats.events >= events and "end" not in clock:
            clock["end"], clock["cpu_end"] = time.perf_counter(), time.process_time()

    daemon._handle = timed  # type: ignore[method-assign]
    task = asyncio.create_task(daemon.run())
    try:
        deadline = time.monotonic() + 120
        while "end" not in clock and time.monotonic() < deadline:
            if task.done():
                task.result()
                raise RuntimeError("daemon stopped")
            await asyncio.sleep(0.01)
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)
    if "end" not in clock:
        raise RuntimeError(f"daemon processed {daemon.stats.events} of {events} events")
    if daemon.stats.commits < daemon.stats.batches or daemon.stats.dead_letters:
        raise RuntimeError(f"daemon run not clean: {daemon.stats.totals()}")
    elapsed = clock["end"] - clock["start"]
    cpu = clock["cpu_end"] - clock["cpu_start"]
    return {"events_per_s": events / elapsed, "seconds": elapsed,
            "batches": float(daemon.stats.batches), "cpu_ms_per_1000": cpu * 1000 / (events / 1000)}


async def _check_names(url: str, prefix: str, names: Mapping[tuple[int, int], Sequence[bytes]]) -> None:
    """Both contenders must delete the same names: write them all, run the daemon's
    delete for every key, and require that none is left."""
    from layered_cache._clients import make_client
    from layered_cache.daemon.deletes import Deleter
    from layered_cache.daemon.stats import DaemonStats

    config = _config(url, prefix, "localhost:9", "unused")
    every = [name for group in names.values() for name in group]
    deleter = Deleter(config)
    client = make_client(config.redis)
    try:
        for start in range(0, len(every), 10_000):
            await client.mset({name: b"x" for name in every[start:start + 10_000]})
        keys = [(group[0].decode(), REPLICAS) for group in names.values()]
        await deleter.delete(keys, DaemonStats())
        left = 0
        for start in range(0, len(every), 10_000):
            left += await client.exists(*every[start:start + 10_000])
    finally:
        await deleter.close()
        await client.aclose()
    if left:
        raise RuntimeError(f"the floor's names are not the daemon's: {left} left after its delete")


async def measure(env: BenchEnv, events: int, rounds: int) -> dict[str, Any]:
    bootstrap = (await asyncio.to_thread(env.kafka)).bootstrap
    url = env.redis_url()
    prefix = unique_prefix("dfl")
    topic = f"bench-dfl-{uuid.uuid4().hex[:6]}"
    names = await _produce(bootstrap, topic, events, prefix)
    await _check_names(url, prefix, names)
    floor: list[dict[str, float]] = []
    daemon: list[dict[str, float]] = []
    for index in range(rounds):
        # Interleaved, each under a fresh group (from offset 0); who goes first alternates
        # (ABBA), so a machine getting busier or quieter favours neither.
        if index % 2:
            daemon.append(await _daemon(_config(url, prefix, bootstrap, topic), events))
            floor.append(await _floor(_config(url, prefix, bootstrap, topic), names))
        else:
            floor.append(await _floor(_config(url, prefix, bootstrap, topic), names))
            daemon.append(await _daemon(_config(url, prefix, bootstrap, topic), events))
        f, d = floor[-1], daemon[-1]
        print(f"   floor {f['events_per_s']:9,.0f}/s ({f['cpu_ms_per_1000']:.0f} ms CPU/1000)   "
              f"daemon {d['events_per_s']:9,.0f}/s ({d['cpu_ms_per_1000']:.0f} ms CPU/1000)",
              flush=True)
    floor_median = median([r["events_per_s"] for r in floor])
    daemon_median = median([r["events_per_s"] for r in daemon])
    return {"events": events, "rounds": rounds, "floor": floor, "daemon": daemon,
            "floor_median": floor_median, "daemon_median": daemon_median,
            "ratio": daemon_median / floor_median,
            # Each round's pair ran back to back: its ratio shares the machine's mood.
            "ratio_per_round_median": median([d["events_per_s"] / f["events_per_s"]
                                              for f, d in zip(floor, daemon, strict=True)]),
            "floor_cpu_ms_per_1000": median([r["cpu_ms_per_1000"] for r in floor]),
            "daemon_cpu_ms_per_1000": median([r["cpu_ms_per_1000"] for r in daemon])}


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("daemon_floor", "9b. Daemon throughput against a getmany + DEL floor (1 process)")
    events, rounds = (5000, 3) if env.quick else (20_000, 7)
    result = await measure(env, events, rounds)
    floor, daemon, ratio = result["floor_median"], result["daemon_median"], result["ratio"]
    section.columns = ["contender", "events/s (median)", "rounds", "ratio to floor",
                       "CPU of this process per 1,000 events (median)"]
    section.rows = [
        ["floor: getmany + one DEL of the batch's 18 names/event", f"{floor:,.0f}",
         ", ".join(f"{r['events_per_s']:,.0f}" for r in result["floor"]), "1.00x",
         f"{result['floor_cpu_ms_per_1000']:.1f} ms"],
        ["daemon: decode, route, 2-phase DEL, backplane XADD, commit", f"{daemon:,.0f}",
         ", ".join(f"{r['events_per_s']:,.0f}" for r in result["daemon"]), f"{ratio:.2f}x",
         f"{result['daemon_cpu_ms_per_1000']:.1f} ms"],
    ]
    section.notes.append(
        f"{events:,} BookPriceChanged events on 4 partitions, max_batch 1000, 8 replicas per key "
        f"(18 names per event); {rounds} interleaved rounds (floor then daemon, then daemon "
        "then floor, ...), each from offset 0 under a fresh consumer group, medians. Both in "
        "this one process, against the same Redis and broker. Ratio = median daemon / median floor; the median of "
        f"the per-round ratios (each pair back to back) is {result['ratio_per_round_median']:.2f}x."
    )
    section.headline.append(Headline(
        "Daemon throughput vs getmany+DEL floor, 1 process, 8 replicas per key",
        f"{daemon:,.0f} events/s ({ratio:.2f}x)", f"floor {floor:,.0f} events/s",
        f">= {RATIO_TARGET}x floor", "ok" if ratio >= RATIO_TARGET else "MISSED",
    ))
    section.data = result
    section.seconds = time.perf_counter() - started
    return section
