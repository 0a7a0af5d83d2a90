"""Consistency soak: writers change the database and publish events while readers read
through two cache instances and the daemon invalidates. Every value a reader gets is
checked against the database history.

`make test` runs a short variant (SOAK_SECONDS, default 12 s); `make soak` runs 60 s.
The figures are printed (run with -s) and written to bench/results/soak.json when
SOAK_REPORT is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaProducer

from consumers import Daemon
from layered_cache import LayeredCache
from layered_cache._config import Config
from layered_cache._event_types import BookPriceChanged, encode_event
from tests.helpers import eventually, make_config, start_relay
from tests.servers import create_topic

pytestmark = [pytest.mark.kafka, pytest.mark.soak]

KEYS = 100
SHELVES = 50  # shelf s shows books s and s + SHELVES: a tagged list page (docs/tags.md)
L1_TTL = 1.0
L1_JITTER = 0.2
# A read may return a superseded value for at most the L1 TTL (the fallback when no
# backplane message arrives) plus the invalidation latency; 1.5 s leaves room for the
# invalidation p99 on a loaded 2-core CI machine.
INVALIDATION_ALLOWANCE = 1.5
BOUND = L1_TTL * (1 + L1_JITTER) + INVALIDATION_ALLOWANCE


class Database:
    """Versions per key, with the time each version was superseded."""

    def __init__(self) -> None:
        self.version = dict.fromkeys(range(KEYS), 1)
        self.superseded_at: dict[tuple[int, int], float] = {}

    def write(self, key: int) -> int:
        old = self.version[key]
        self.version[key] = old + 1
        self.superseded_at[(key, old)] = time.monotonic()
        return old + 1


def soak_config(redis_url: str, prefix: str, bootstrap: str, topic: str) -> Any:
    return make_config(
        redis_url,
        prefix,
        {
            "book": {
                "key": "book:{id}",
                "l1": {"ttl": f"{L1_TTL}s", "jitter": L1_JITTER},
                "l2": {"ttl": "30s"},
                "stampede": {"lease_ttl": "2s", "max_wait": "1s"},
            },
            "shelf": {
                "key": "shelf:{id}",
                "tags": True,
                "l1": {"ttl": f"{L1_TTL}s", "jitter": L1_JITTER},
                "l2": {"ttl": "30s"},
                "stampede": {"lease_ttl": "2s", "max_wait": "1s"},
            },
        },
        backplane={"block": "200ms"},
        kafka={
            "bootstrap_servers": bootstrap,
            "topics": [topic],
            "group_id": f"soak-{uuid.uuid4().hex[:8]}",
            "dead_letter_topic": f"{topic}.dlq",
            "session_timeout": "2s",
            "heartbeat_interval": "200ms",
            "rebalance_timeout": "1s",
            "retry_max_backoff": "200ms",
            "health_port": -1,
        },
        events=[
            {
                "type": "BookPriceChanged",
                "invalidate": [
                    {"namespace": "book", "key": {"id": "book_id"}},
                    {"tag": "book:{book_id}"},
                ],
            }
        ],
    )


@contextlib.asynccontextmanager
async def fanned_out(config: Config, fanout: str) -> AsyncIterator[Config]:
    """``config`` as is (every instance reads the stream), or with a relay in between
    (``backplane.relay``, docs/operations.md "Fan-out")."""
    if fanout == "direct":
        yield config
        return
    relay, url = await start_relay(config)
    try:
        backplane = msgspec.structs.replace(config.backplane, relay=url)
        yield msgspec.structs.replace(config, backplane=backplane)
    finally:
        await relay.close()


@pytest.mark.parametrize("fanout", ["direct", "relay"])
async def test_no_read_is_staler_than_the_promise(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str, fanout: str
) -> None:
    seconds = float(os.environ.get("SOAK_SECONDS", "12"))
    await create_topic(kafka_bootstrap, unique_topic, partitions=4)
    base = soak_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    async with fanned_out(base, fanout) as config:
        await _soak(config, seconds, fanout, kafka_bootstrap, unique_topic)


async def _soak(
    config: Config, seconds: float, fanout: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    database = Database()
    counts = {"reads": 0, "writes": 0, "events": 0, "violations": 0, "loads": 0}
    worst = 0.0
    violations: list[str] = []

    async def load_for(key: int) -> int:
        counts["loads"] += 1
        version = database.version[key]
        await asyncio.sleep(random.uniform(0.001, 0.01))  # the query takes a moment
        return version

    def books_of(shelf: int) -> list[int]:
        return [shelf, shelf + SHELVES]

    async def load_shelf(shelf: int) -> list[int]:
        counts["loads"] += 1
        versions = [database.version[book] for book in books_of(shelf)]
        await asyncio.sleep(random.uniform(0.001, 0.01))
        return versions

    def tags_of(shelf: int) -> list[str]:
        return [f"book:{book}" for book in books_of(shelf)]

    def check(key: int, version: int) -> None:
        nonlocal worst
        superseded = database.superseded_at.get((key, version))
        if superseded is not None:
            staleness = time.monotonic() - superseded
            worst = max(worst, staleness)
            if staleness > BOUND:
                counts["violations"] += 1
                violations.append(f"book {key} v{version}: {staleness:.2f}s stale")

    daemon = Daemon(config)
    daemon_task = asyncio.create_task(daemon.run())
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=2)
    await producer.start()
    try:
        assert await eventually(lambda: bool(daemon.assignment), timeout=20)
        async with LayeredCache.from_config(config) as one, LayeredCache.from_config(config) as two:
            instances = (one, two)
            stop_at = time.monotonic() + seconds
            # The workload lasts ``seconds`` and at least until it has done enough to judge
            # (a starved machine does fewer reads per second), within 5x that.
            give_up_at = time.monotonic() + 5 * seconds

            def running() -> bool:
                now = time.monotonic()
                enough = counts["reads"] > 1000 and counts["writes"] > 100
                return now < give_up_at and (now < stop_at or not enough)

            async def writer() -> None:
                while running():
                    key = random.randrange(KEYS)
                    database.write(key)
                    counts["writes"] += 1
                    event = BookPriceChanged(key, "1.00", "2.00", "2026-11-29T10:00:00Z")
                    await producer.send(unique_topic, encode_event(event), key=str(key).encode())
                    counts["events"] += 1
                    await asyncio.sleep(random.uniform(0.005, 0.03))

            async def reader(instance: LayeredCache) -> None:
                while running():
                    if random.random() < 0.3:  # a list page: every book on it is checked
                        shelf = random.randrange(SHELVES)
                        versions = await instance.get_or_load(
                            "shelf",
                            {"id": shelf},
                            lambda shelf=shelf: load_shelf(shelf),
                            tags=tags_of(shelf),
                        )
                        for book, version in zip(books_of(shelf), versions, strict=True):
                            check(book, version)
                    else:
                        key = random.randrange(KEYS)
                        version = await instance.get_or_load(
                            "book", {"id": key}, lambda key=key: load_for(key)
                        )
                        check(key, version)
                    counts["reads"] += 1
                    await asyncio.sleep(0.001)

            await asyncio.gather(
                writer(),
                writer(),
                *(reader(instance) for instance in instances for _ in range(10)),
            )
            await producer.flush()

            # Settle: afterwards every key reads as the database's current version.
            async def settled() -> bool:
                for instance in instances:
                    for key in range(KEYS):
                        got = await instance.get_or_load(
                            "book", {"id": key}, lambda key=key: load_for(key)
                        )
                        if got != database.version[key]:
                            return False
                    for shelf in range(SHELVES):
                        page = await instance.get_or_load(
                            "shelf",
                            {"id": shelf},
                            lambda shelf=shelf: load_shelf(shelf),
                            tags=tags_of(shelf),
                        )
                        if page != [database.version[book] for book in books_of(shelf)]:
                            return False
                return True

            assert await eventually(settled, timeout=BOUND + 10, interval=0.5)
    finally:
        await producer.stop()
        daemon.stop()
        await asyncio.wait_for(daemon_task, 20)

    report = {
        **counts,
        "fanout": fanout,
        "seconds": seconds,
        "worst_staleness_s": round(worst, 3),
        "bound_s": BOUND,
    }
    print("\nconsistency soak:", json.dumps(report))
    if os.environ.get("SOAK_REPORT"):  # soak.json (direct), soak-relay.json
        path = Path(os.environ["SOAK_REPORT"])
        if fanout != "direct":
            path = path.with_name(f"{path.stem}-{fanout}{path.suffix}")
        path.write_text(json.dumps(report, indent=2) + "\n")
    assert violations == [], violations[:10]
    assert counts["reads"] > 1000 and counts["writes"] > 100
