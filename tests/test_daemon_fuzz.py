"""Kafka-level fuzz: hostile messages between valid events, through the real broker.

Hypothesis draws batches of messages - random bytes, random JSON, 2,000-deep nesting,
5,000-digit integers, oversized values, huge namespaces, unsafe or mistyped key values,
unknown types, tombstones, messages with neither key nor value, random keys and headers -
interleaved with valid events, and produces each batch with librdkafka under a random
codec (none, gzip, snappy, lz4, zstd) over two partitions. One daemon (in a thread of its
own) consumes everything. After every batch:

- the daemon is still running;
- every valid event's keys are gone from Redis;
- the group's offsets are committed to the end of both partitions;
- every poison message is on the dead-letter topic with a reason, every tombstone counted.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import redis
from confluent_kafka import Consumer as RdKafkaConsumer
from confluent_kafka import Producer as RdKafkaProducer
from confluent_kafka import TopicPartition as RdTopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layered_cache._config import Config
from layered_cache._events import EventDecoder, PoisonEvent
from layered_cache.daemon import Daemon
from tests.servers import create_topic
from tests.test_daemon import daemon_config

pytestmark = pytest.mark.kafka

MAX_EVENT_BYTES = 20_000  # small, so "oversized" stays cheap to produce
PARTITIONS = 2
CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
_ids = itertools.count(1)
totals = {"messages": 0, "valid": 0, "poison": 0, "tombstones": 0, "batches": 0}


class DaemonThread:
    """The daemon on an event loop of its own, so the hypothesis test can stay sync."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.daemon: Daemon | None = None
        self.error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fuzz-daemon", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.daemon = Daemon(self.config)
            await self.daemon.run()

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by alive()
            self.error = exc

    def start(self) -> Daemon:
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.daemon is not None and self.daemon.assignment:
                return self.daemon
            assert self.alive(), self.error
            time.sleep(0.05)
        raise AssertionError("the daemon never got its partitions")

    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self) -> None:
        if self.daemon is not None:
            self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(30)


class Fuzz:
    def __init__(self, config: Config, redis_url: str, bootstrap: str) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.topic = config.kafka.topics[0]
        self.decoder = EventDecoder(config)
        self.redis = redis.Redis.from_url(redis_url)
        self.prefix = config.redis.prefix
        self.dlq = RdKafkaConsumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"fuzz-dlq-{uuid.uuid4().hex[:6]}",
                "enable.auto.commit": False,
            }
        )
        self.dlq.assign([RdTopicPartition(config.kafka.dead_letter_topic, 0, 0)])
        self.dead: dict[tuple[int, int], str] = {}  # (partition, offset) -> reason
        self.committer = RdKafkaConsumer(
            {"bootstrap.servers": bootstrap, "group.id": config.kafka.group_id}
        )

    def committed(self) -> list[int]:
        tps = [RdTopicPartition(self.topic, p) for p in range(PARTITIONS)]
        return [max(tp.offset, 0) for tp in self.committer.committed(tps, timeout=5)]

    def read_dead_letters(self) -> None:
        for message in self.dlq.consume(num_messages=500, timeout=0.2):
            if message.error():
                continue
            headers = dict(message.headers() or [])
            where = (
                int(headers["dlq.original.partition"]),
                int(headers["dlq.original.offset"]),
            )
            self.dead[where] = headers["dlq.reason"].decode()

    def close(self) -> None:
        self.dlq.close()
        self.committer.close()
        self.redis.close()


@pytest.fixture
def fuzz(redis_url: str, prefix: str, kafka_bootstrap: str) -> Iterator[tuple[Fuzz, DaemonThread]]:
    topic = f"fuzz-{uuid.uuid4().hex[:8]}"
    config = daemon_config(
        redis_url,
        prefix,
        kafka_bootstrap,
        topic,
        max_event_bytes=MAX_EVENT_BYTES,
        max_batch=200,
    )
    asyncio.run(create_topic(kafka_bootstrap, topic, PARTITIONS))
    asyncio.run(create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1))
    runner = DaemonThread(config)
    runner.start()
    state = Fuzz(config, redis_url, kafka_bootstrap)
    try:
        yield state, runner
    finally:
        runner.stop()
        state.close()
        print(f"\nKafka fuzz: {totals}")


# -- what one message can be ----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
# Occasionally a key or headers over what a DLQ record keeps (16 KiB of key, 64 KiB of
# headers): the record must still be written, truncated, with the original sizes noted.
keys = st.one_of(
    st.none(), st.binary(max_size=64), st.integers(17_000, 40_000).map(lambda n: b"k" * n)
)
headers = st.one_of(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=12), st.none() | st.binary(max_size=2_000)),
        max_size=4,
    ),
    st.integers(1, 3).map(lambda n: [(f"big{i}", b"h" * 40_000) for i in range(n)]),
)


def valid_event(draw: Any) -> tuple[bytes, list[int]]:
    ids = [next(_ids) for _ in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        body: dict[str, Any] = {
            "type": "BookPriceChanged",
            "book_id": ids[0],
            "old_price": "1.00",
            "new_price": "2.00",
            "extra": draw(json_values),  # unrouted fields never block an invalidation
        }
        return msgspec.json.encode(body), ids[:1]
    keys_ = [{"id": i} for i in ids]
    return msgspec.json.encode({"type": "CacheInvalidate", "namespace": "book", "keys": keys_}), ids


hostile_values = st.one_of(
    st.binary(max_size=300),
    json_values.map(msgspec.json.encode),
    st.integers(500, 5_000).map(lambda n: b"[" * n),
    st.integers(500, 3_000).map(lambda n: b'{"a":' * n),
    st.integers(20, 6_000).map(lambda n: b'{"type": "BookPriceChanged", "book_id": ' + b"9" * n + b"}"),
    st.integers(MAX_EVENT_BYTES + 1, 3 * MAX_EVENT_BYTES).map(lambda n: b"x" * n),
    st.integers(100, MAX_EVENT_BYTES - 100).map(
        lambda n: msgspec.json.encode({"type": "CacheInvalidate", "namespace": "n" * n, "keys": []})
    ),
    st.sampled_from(["a b", "", "{x}", "k#1", "é", "x" * 300]).map(
        lambda v: msgspec.json.encode({"type": "CacheInvalidate", "namespace": "book", "keys": [{"id": v}]})
    ),
    json_values.map(lambda v: msgspec.json.encode({"type": "BookPriceChanged", "book_id": v})),
    st.text(max_size=30).map(lambda t: msgspec.json.encode({"type": t})),
    st.just(b""),
)


@st.composite
def batches(draw: Any) -> tuple[str, list[tuple[bytes | None, bytes | None, list[Any], str, list[int]]]]:
    """(codec, [(key, value, headers, kind, ids)]) with kind valid / poison / tombstone."""
    items = []
    for _ in range(draw(st.integers(5, 60))):
        kind = draw(st.sampled_from(["valid", "valid", "hostile", "hostile", "tombstone"]))
        key, hdrs = draw(keys), draw(headers)
        if kind == "valid":
            value, ids = valid_event(draw)
            items.append((key, value, hdrs, "valid", ids))
        elif kind == "tombstone":
            items.append((key, None, hdrs, "tombstone", []))  # key may be None: neither
        else:
            items.append((key, draw(hostile_values), hdrs, "hostile", []))
    return draw(st.sampled_from(CODECS)), items


# The daemon's thread draws from `random` (backoff jitter, aiokafka) while hypothesis
# generates: that is the system under test, not the strategy using `random`.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
@given(batch=batches())
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_daemon_survives_any_message_and_moves_every_partition_to_the_end(
    batch: tuple[str, list[Any]], fuzz: tuple[Fuzz, DaemonThread]
) -> None:
    state, runner = fuzz
    codec, items = batch
    assert runner.alive(), runner.error
    daemon = runner.daemon
    assert daemon is not None
    tombstones_before = daemon.stats.tombstones
    valid_ids = [i for *_, kind, ids in items if kind == "valid" for i in ids]
    names = [f"{state.prefix}book:{i}" for i in valid_ids]
    if names:
        state.redis.mset({name: b"old" for name in names})

    positions: dict[int, tuple[int, int]] = {}
    producer = RdKafkaProducer(
        {
            "bootstrap.servers": state.bootstrap,
            "compression.type": codec,
            "linger.ms": 5,
            "message.max.bytes": 2_000_000,
        }
    )
    for index, (key, value, hdrs, _kind, _ids) in enumerate(items):

        def delivered(err: Any, msg: Any, index: int = index) -> None:
            assert err is None, err
            positions[index] = (msg.partition(), msg.offset())

        producer.produce(
            state.topic,
            value=value,
            key=key,
            headers=hdrs or None,
            partition=index % PARTITIONS,
            on_delivery=delivered,
        )
    assert producer.flush(20) == 0
    assert len(positions) == len(items)
    ends = [
        1 + max((off for part, off in positions.values() if part == p), default=-1)
        for p in range(PARTITIONS)
    ]

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        committed = state.committed()
        if all(c >= e for c, e in zip(committed, ends, strict=True)):
            break
        assert runner.alive(), runner.error
        time.sleep(0.05)
    else:
        raise AssertionError(f"committed {state.committed()}, end {ends}; {daemon.stats}")

    assert runner.alive(), runner.error
    assert not names or state.redis.exists(*names) == 0
    poison = []
    for index, (_key, value, _hdrs, kind, _ids) in enumerate(items):
        if kind != "hostile":
            continue
        try:
            state.decoder.decode(value)
        except PoisonEvent:
            poison.append(positions[index])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(p in state.dead for p in poison):
        state.read_dead_letters()
    missing = [p for p in poison if p not in state.dead]
    assert not missing, missing
    assert all(state.dead[p] for p in poison)
    tombstones = sum(1 for item in items if item[3] == "tombstone")
    assert daemon.stats.tombstones - tombstones_before == tombstones
    totals["messages"] += len(items)
    totals["valid"] += sum(1 for item in items if item[3] == "valid")
    totals["poison"] += len(poison)
    totals["tombstones"] += tombstones
    totals["batches"] += 1
