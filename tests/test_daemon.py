"""The invalidation daemon against real Redis and the real Kafka-protocol broker.

Each scenario drives the daemon the way production does (events produced to Kafka) and
checks outcomes in Redis, in the caches' L1 and in the group's committed offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from consumers import Daemon
from layered_cache import Config, LayeredCache
from layered_cache.events import BookPriceChanged, encode_event
from layered_cache.keys import lease_name, replica_names
from layered_cache.l1 import MISSING
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import FAST_GROUP_KWARGS, RedisServer, create_topic

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent
ROUTES = [{"type": "BookPriceChanged", "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}]}]


# -- builders ----------------------------------------------------------------------------


def daemon_config(
    redis_url: str,
    prefix: str,
    bootstrap: str,
    topic: str,
    *,
    group: str | None = None,
    namespaces: dict[str, dict[str, Any]] | None = None,
    **kafka: Any,
) -> Config:
    """Fast group timings (the broker forms groups slowly with defaults), short backoff."""
    section = {
        "bootstrap_servers": bootstrap,
        "topics": [topic],
        "group_id": group or f"g-{uuid.uuid4().hex[:8]}",
        "dead_letter_topic": f"{topic}.dlq",
        "session_timeout": "2s",
        "heartbeat_interval": "200ms",
        "rebalance_timeout": "1s",
        "retry_max_backoff": "200ms",
        "health_port": -1,
        **kafka,
    }
    return make_config(
        redis_url,
        prefix,
        namespaces or {"book": {"key": "book:{id}", "hot": {"replicas": 8}}},
        kafka=section,
        events=ROUTES,
    )


def price_changed(book_id: int) -> bytes:
    return encode_event(BookPriceChanged(book_id, "12.90", "9.90", "2026-11-29T10:00:00Z"))


@contextlib.asynccontextmanager
async def running(daemon: Daemon, *, assigned: bool = True) -> AsyncIterator[Daemon]:
    """Run the daemon in this loop; on exit stop it gracefully and surface its errors."""
    task = asyncio.create_task(daemon.run())
    try:
        if assigned:
            ok = await eventually(lambda: bool(daemon.assignment) or task.done(), timeout=20)
            if task.done():
                task.result()
            assert ok, "daemon never got partitions"
        yield daemon
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 20)


@contextlib.asynccontextmanager
async def producer(bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=4_000_000)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def committed(bootstrap: str, group: str, tps: Iterable[TopicPartition]) -> dict[int, int]:
    """The group's committed offset per partition (0 when nothing was committed)."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        return {tp.partition: (await c.committed(tp)) or 0 for tp in tps}
    finally:
        await c.stop()


async def seed(client: aioredis.Redis, keys: Iterable[str], replicas: int = 0) -> None:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        for name in [key, *replica_names(key, replicas), lease_name(key)]:
            pipe.set(name, b"old", ex=600)
    await pipe.execute()


async def existing(client: aioredis.Redis, keys: list[str]) -> list[str]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return [key for key, there in zip(keys, await pipe.execute(), strict=True) if there]


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


# -- scenarios ---------------------------------------------------------------------------


async def test_price_change_reaches_every_instance_within_a_second(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    redis_client: aioredis.Redis,
) -> None:
    namespaces = {
        "book": {
            "key": "book:{id}",
            "l1": {"ttl": "60s"},
            "hot": {"replicas": 8, "keys": ["book:42"]},
        }
    }
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, namespaces=namespaces)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    key = f"{prefix}book:42"
    names = [key, *replica_names(key, 8), lease_name(key)]
    async with (
        LayeredCache.from_config(config) as a,
        LayeredCache.from_config(config) as b,
        running(Daemon(config)),
        producer(kafka_bootstrap) as p,
    ):
        assert await a.get_or_load("book", {"id": 42}, CountingLoader("12.90")) == "12.90"
        assert await b.get_or_load("book", {"id": 42}, CountingLoader("other")) == "12.90"
        await b.l2.client.set(lease_name(key), b"in-flight-fill", ex=30)  # a load in progress
        assert len(await existing(redis_client, names)) == 10
        l1s = [a.policy("book").l1, b.policy("book").l1]
        assert all(l1 is not None and l1.get(key) == "12.90" for l1 in l1s)

        started = time.monotonic()
        await p.send_and_wait(unique_topic, price_changed(42))

        async def everything_gone() -> bool:
            in_l1 = [l1.get(key) for l1 in l1s if l1 is not None]
            return not await existing(redis_client, names) and all(v is MISSING for v in in_l1)

        assert await eventually(everything_gone, timeout=3, interval=0.005)
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"took {elapsed:.3f}s"

        fresh = CountingLoader("9.90")
        assert await a.get_or_load("book", {"id": 42}, fresh) == "9.90"
        assert await b.get_or_load("book", {"id": 42}, fresh) == "9.90"
        assert fresh.calls == 1  # one load fleet-wide, the other read the new L2 value


async def test_poison_messages_go_to_the_dlq_and_valid_neighbours_are_processed(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    redis_client: aioredis.Redis,
) -> None:
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    valid = [1, 2, 3, 4, 5]
    await seed(redis_client, [f"{prefix}book:{i}" for i in valid], replicas=8)
    messages = [
        price_changed(1),
        b"this is not json",
        price_changed(2),
        b'{"type": "AuthorRenamed", "author_id": 7}',
        price_changed(3),
        b'{"type": "BookPriceChanged", "old_price": "1.00"}',
        price_changed(4),
        b'{"type": "BookPriceChanged", "book_id": 9, "pad": "' + b"x" * 1_048_576 + b'"}',
        price_changed(5),
    ]
    daemon = Daemon(config)
    async with running(daemon), producer(kafka_bootstrap) as p:
        for message in messages:
            await p.send(unique_topic, message, partition=0)
        await p.flush()
        tp = TopicPartition(unique_topic, 0)
        assert await eventually(lambda: _done(daemon, len(messages)), timeout=15)
    assert await committed(kafka_bootstrap, config.kafka.group_id, [tp]) == {0: len(messages)}
    keys = [f"{prefix}book:{i}" for i in valid]
    assert await existing(redis_client, keys) == []
    assert daemon.stats.events == 5 and daemon.stats.dead_letters == 4

    dead = await read_all(kafka_bootstrap, config.kafka.dead_letter_topic, 4)
    headers = [dict(m.headers) for m in dead]
    reasons = [h["dlq.reason"].decode() for h in headers]
    assert reasons[0].startswith("not JSON")
    assert reasons[1] == "unknown event type 'AuthorRenamed'"
    assert "missing field 'book_id'" in reasons[2]
    assert "exceeds max_event_bytes" in reasons[3]
    assert [int(h["dlq.original.offset"]) for h in headers] == [1, 3, 5, 7]
    assert {h["dlq.original.topic"].decode() for h in headers} == {unique_topic}
    assert {h["dlq.original.partition"] for h in headers} == {b"0"}
    assert dead[0].value == b"this is not json"
    assert int(headers[3]["dlq.original.size"]) > 1_048_576  # truncated copy, size noted


def _done(daemon: Daemon, count: int) -> bool:
    return daemon.stats.events + daemon.stats.dead_letters >= count and daemon.stats.commits > 0


async def read_all(bootstrap: str, topic: str, count: int, timeout: float = 10) -> list[Any]:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await c.start()
    try:
        partitions = c.partitions_for_topic(topic) or {0}
        c.assign([TopicPartition(topic, p) for p in sorted(partitions)])
        await c.seek_to_beginning()
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            for records in (await c.getmany(timeout_ms=200)).values():
                out.extend(records)
        return sorted(out, key=lambda m: (m.partition, m.offset))
    finally:
        await c.stop()
