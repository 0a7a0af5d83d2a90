"""Daemon throughput with a poison message every 100 events, against clean throughput.

    python -m bench.daemon_poison [--events 20000] [--every 100] [--repeats 3]

Starts its own Redis and tansu broker (tests/servers.py). For each run, N events are
produced up front to a fresh 4-partition topic (``BookPriceChanged``, 8 replicas per key,
so 18 Redis names per key with replica leases); in the poisoned variant every
``--every``-th message is replaced by a poison one (cycling through not-JSON, an unknown
type, 2,000 nested ``[`` and a 5,000-digit integer). A fresh daemon in this process then
drains the topic; the figure is messages per second from its first batch to the commit
covering the last message. Each variant is run ``--repeats`` times, median reported.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
import uuid

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from layered_cache._config import parse_config
from layered_cache._event_types import BookPriceChanged, encode_event
from layered_cache.daemon import Daemon
from tests.servers import FAST_GROUP_KWARGS, KafkaBroker, RedisServer, create_topic

PARTITIONS = 4
POISON = [
    b"this is not json",
    b'{"type": "AuthorRenamed", "author_id": 7}',
    b"[" * 2000,
    b'{"type": "BookPriceChanged", "book_id": ' + b"9" * 5000 + b"}",
]


def _config(redis_url: str, bootstrap: str, topic: str) -> object:
    raw = {
        "redis": {"url": redis_url, "prefix": f"b{uuid.uuid4().hex[:6]}:"},
        "kafka": {
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            "group_id": f"bench-{uuid.uuid4().hex[:6]}",
            "dead_letter_topic": f"{topic}.dlq",
            "session_timeout": FAST_GROUP_KWARGS["session_timeout_ms"] / 1000,
            "heartbeat_interval": FAST_GROUP_KWARGS["heartbeat_interval_ms"] / 1000,
            "rebalance_timeout": FAST_GROUP_KWARGS["rebalance_timeout_ms"] / 1000,
            "health_port": -1,
        },
        "namespaces": {"book": {"key": "book:{id}", "hot": {"replicas": 8}}},
        "events": [
            {"type": "BookPriceChanged", "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}]}
        ],
    }
    return parse_config(raw, source="<bench>", env={})


async def _produce(bootstrap: str, topic: str, events: int, every: int) -> int:
    await create_topic(bootstrap, topic, PARTITIONS)
    await create_topic(bootstrap, f"{topic}.dlq", 1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=262144)
    await producer.start()
    poison = 0
    try:
        futures = []
        for i in range(events):
            if every and i % every == every - 1:
                value = POISON[poison % len(POISON)]
                poison += 1
            else:
                value = encode_event(BookPriceChanged(i, "12.90", "9.90", "2026-11-29T10:00:00Z"))
            futures.append(await producer.send(topic, value, partition=i % PARTITIONS))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return poison


async def _committed(bootstrap: str, group: str, topic: str) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        return sum([(await c.committed(TopicPartition(topic, p))) or 0 for p in range(PARTITIONS)])
    finally:
        await c.stop()


async def one_run(redis_url: str, bootstrap: str, events: int, every: int) -> dict[str, float]:
    topic = f"bench-poison-{uuid.uuid4().hex[:6]}"
    poison = await _produce(bootstrap, topic, events, every)
    config = _config(redis_url, bootstrap, topic)
    daemon = Daemon(config)  # type: ignore[arg-type]
    task = asyncio.create_task(daemon.run())
    try:
        while daemon.stats.batches == 0:
            if task.done():
                task.result()
            await asyncio.sleep(0.001)
        started = time.perf_counter()
        while daemon.stats.events + daemon.stats.dead_letters < events:
            if task.done():
                task.result()
            await asyncio.sleep(0.002)
        elapsed = time.perf_counter() - started
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)
    group = daemon.config.kafka.group_id
    assert await _committed(bootstrap, group, topic) == events, "not committed to the end"
    assert daemon.stats.dead_letters == poison
    return {"messages_per_s": events / elapsed, "seconds": elapsed, "poison": poison}


async def main_async(args: argparse.Namespace) -> None:
    with RedisServer() as redis_server, KafkaBroker() as broker:
        results: dict[str, list[dict[str, float]]] = {"clean": [], "poisoned": []}
        for _ in range(args.repeats):
            for name, every in (("clean", 0), ("poisoned", args.every)):
                run = await one_run(redis_server.url, broker.bootstrap, args.events, every)
                results[name].append(run)
                print(f"{name:9s} {run['messages_per_s']:8,.0f} msg/s  ({run['poison']:.0f} poison)")
        clean = statistics.median(r["messages_per_s"] for r in results["clean"])
        poisoned = statistics.median(r["messages_per_s"] for r in results["poisoned"])
        print(
            f"\n{args.events:,} messages, 4 partitions, max_batch 1000, median of {args.repeats}:\n"
            f"  clean:                          {clean:,.0f} messages/s\n"
            f"  a poison message every {args.every}:     {poisoned:,.0f} messages/s "
            f"({poisoned / clean:.0%} of clean)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.daemon_poison", description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    logging.basicConfig(level=logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
