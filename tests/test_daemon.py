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
from layered_cache._event_types import BookPriceChanged, encode_event
from layered_cache._keys import lease_name, replica_names
from layered_cache._l1 import MISSING
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import FAST_GROUP_KWARGS, RedisServer, create_topic

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent
ROUTES = [
    {"type": "BookPriceChanged", "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}]}
]


# -- builders ----------------------------------------------------------------------------


def daemon_config(
    redis_url: str,
    prefix: str,
    bootstrap: str,
    topic: str,
    *,
    group: str | None = None,
    namespaces: dict[str, dict[str, Any]] | None = None,
    routes: list[dict[str, Any]] | None = None,
    **kafka: Any,
) -> Config:
    """Fast group timings (the broker forms groups slowly with defaults), short backoff."""
    section = {
        "bootstrap_servers": bootstrap,
        "topics": [topic],
        "group_id": group or f"g-{uuid.uuid4().hex[:8]}",
        "dead_letter_topic": f"{topic}.dlq",
        # The broker's group timing: the fixtures' fast settings, as config durations.
        "session_timeout": FAST_GROUP_KWARGS["session_timeout_ms"] / 1000,
        "heartbeat_interval": FAST_GROUP_KWARGS["heartbeat_interval_ms"] / 1000,
        "rebalance_timeout": FAST_GROUP_KWARGS["rebalance_timeout_ms"] / 1000,
        "retry_max_backoff": "200ms",
        "health_port": -1,
        **kafka,
    }
    return make_config(
        redis_url,
        prefix,
        namespaces or {"book": {"key": "book:{id}", "hot": {"replicas": 8}}},
        kafka=section,
        events=ROUTES if routes is None else routes,
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
    """The group's committed offset per partition (0 when nothing was committed).

    Bounded: an aiokafka consumer's start (coordinator lookup) has no deadline of its
    own, and under make test-stress one such call hung a whole suite run; a timeout here
    is an ordinary failure (or, in ``committed_total``, a "not yet")."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        async with asyncio.timeout(20):
            await c.start()
            return {tp.partition: (await c.committed(tp)) or 0 for tp in tps}
    finally:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
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


# -- scenarios ---------------------------------------------------------------------------


async def test_price_change_reaches_every_instance_within_a_second(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
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
        await b._store.client.set(lease_name(key), b"in-flight-fill", ex=30)  # a load in progress
        assert len(await existing(redis_client, names)) == 10
        l1s = [a.namespace("book").policy.l1, b.namespace("book").policy.l1]
        assert all(l1 is not None and l1.get(key) == "12.90" for l1 in l1s)

        started = time.monotonic()
        await p.send_and_wait(unique_topic, price_changed(42))

        async def everything_gone() -> bool:
            in_l1 = [l1.get(key) for l1 in l1s if l1 is not None]
            return not await existing(redis_client, names) and all(v is MISSING for v in in_l1)

        assert await eventually(everything_gone, timeout=3, interval=0.005)
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"took {elapsed:.3f}s"
        print(f"event -> L2 keys and both L1 copies gone in {elapsed * 1000:.0f} ms")

        fresh = CountingLoader("9.90")
        assert await a.get_or_load("book", {"id": 42}, fresh) == "9.90"
        assert await b.get_or_load("book", {"id": 42}, fresh) == "9.90"
        assert fresh.calls == 1  # one load fleet-wide, the other read the new L2 value


async def test_poison_messages_go_to_the_dlq_and_valid_neighbours_are_processed(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
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


async def test_an_event_type_routed_to_nothing_is_acknowledged_not_dead_lettered(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
) -> None:
    """docs/daemon.md: a route with ``invalidate = []`` acknowledges a type that
    invalidates nothing (the config refused it: ``expected array of length >= 1``)."""
    routes = [*ROUTES, {"type": "BookReviewed", "invalidate": []}]
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, routes=routes)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    await seed(redis_client, [f"{prefix}book:1"], replicas=8)
    reviewed = b'{"type": "BookReviewed", "book_id": 1, "stars": 5}'
    messages = [reviewed, price_changed(1), reviewed]
    daemon = Daemon(config)
    tp = TopicPartition(unique_topic, 0)
    async with running(daemon), producer(kafka_bootstrap) as p:
        for message in messages:
            await p.send(unique_topic, message, partition=0)
        await p.flush()
        assert await eventually(lambda: _done(daemon, len(messages)), timeout=15)
    assert await committed(kafka_bootstrap, config.kafka.group_id, [tp]) == {0: len(messages)}
    assert daemon.stats.event_types == {"BookReviewed": 2, "BookPriceChanged": 1}
    assert daemon.stats.dead_letters == 0
    assert await existing(redis_client, [f"{prefix}book:1"]) == []


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


async def test_health_and_metrics_endpoints_report_progress(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    daemon = Daemon(config, health_port=0)
    async with running(daemon), producer(kafka_bootstrap) as p:
        assert daemon.health is not None and daemon.health.bound_port
        port = daemon.health.bound_port
        await p.send_and_wait(unique_topic, price_changed(7))
        assert await eventually(lambda: daemon.stats.commits >= 1, timeout=10)
        status, body = await http_get(port, "/readyz")
        assert status == 200 and msgspec.json.decode(body)["events"] == 1
        status, body = await http_get(port, "/metrics")
        text = body.decode()
        assert status == 200
        assert 'layered_cache_daemon_events_total{type="BookPriceChanged"} 1.0' in text
        assert "layered_cache_daemon_keys_invalidated_total 1.0" in text
        for name in ("dead_letters_total", "batch_seconds_bucket", "lag{", "redis_retries_total"):
            assert f"layered_cache_daemon_{name}" in text
        assert (await http_get(port, "/nope"))[0] == 404


async def test_events_of_a_transactional_producer_are_committed_to_the_end_and_leave_no_lag(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    redis_client: aioredis.Redis,
) -> None:
    """docs/daemon.md (metrics): the lag gauge is the end offset minus the committed one.
    A transactional producer (Debezium or Kafka Streams exactly-once outboxes, librdkafka
    ``transactional.id``) ends each transaction with a commit marker, a record aiokafka
    never hands over: the daemon committed last record + 1, one short of the end for
    ever, so the gauge (and any monitor of the group's lag) said 1 with everything applied."""
    from confluent_kafka import Producer as RdKafkaProducer

    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    tp = TopicPartition(unique_topic, 0)
    daemon = Daemon(config, health_port=0)
    rd = RdKafkaProducer({"bootstrap.servers": kafka_bootstrap,
                          "transactional.id": f"tx-{unique_topic}"})
    await asyncio.to_thread(rd.init_transactions, 10)

    async def transaction(*books: int) -> None:
        rd.begin_transaction()
        for book in books:
            rd.produce(unique_topic, value=price_changed(book), partition=0)
        await asyncio.to_thread(rd.commit_transaction, 10)

    async def committed_to(end: int) -> bool:
        return (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] == end

    async with running(daemon):
        assert daemon.health is not None and daemon.health.bound_port
        port = daemon.health.bound_port
        for end, books in ((3, (1, 2)), (7, (3, 4, 5))):  # the records and their marker
            await seed(redis_client, [f"{prefix}book:{b}" for b in books], replicas=8)
            await transaction(*books)
            assert await eventually(lambda end=end: committed_to(end), timeout=15), daemon.lag
            assert await existing(redis_client, [f"{prefix}book:{b}" for b in books]) == []
        assert await eventually(lambda: daemon.lag == {(unique_topic, 0): 0}, timeout=10)
        text = (await http_get(port, "/metrics"))[1].decode()
    assert f'layered_cache_daemon_lag{{partition="0",topic="{unique_topic}"}} 0.0' in text


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_redis_outage_delays_deletes_and_commits_never_run_ahead(
    prefix: str, kafka_bootstrap: str, unique_topic: str, tmp_path: Path
) -> None:
    # AOF with fsync always: the seeded keys survive the restart, so "deleted" is real.
    server = RedisServer(extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    with server:
        config = daemon_config(server.url, prefix, kafka_bootstrap, unique_topic)
        group = config.kafka.group_id
        tps = [TopicPartition(unique_topic, p) for p in range(2)]
        await create_topic(kafka_bootstrap, unique_topic, 2)
        client = aioredis.Redis.from_url(server.url, socket_timeout=0.5)
        key = f"{prefix}book:{{}}".format
        await seed(client, [key(i) for i in range(300)], replicas=8)
        where: dict[tuple[int, int], str] = {}  # (partition, offset) -> key of that event
        daemon = Daemon(config)
        async with running(daemon), producer(kafka_bootstrap) as p:

            async def produce(ids: range) -> None:
                futures = [
                    await p.send(unique_topic, price_changed(i), partition=i % 2) for i in ids
                ]
                for i, meta in zip(ids, await asyncio.gather(*futures), strict=True):
                    where[(meta.partition, meta.offset)] = key(i)

            await produce(range(100))
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, group, tps, 100), timeout=10
            )
            before = await committed(kafka_bootstrap, group, tps)

            server.stop()
            await produce(range(100, 200))
            assert await eventually(lambda: daemon.stats.redis_retries >= 3, timeout=10)
            assert await committed(kafka_bootstrap, group, tps) == before  # nothing ran ahead

            violations: list[str] = []
            samples = 0

            async def check_commits_follow_deletes() -> None:
                nonlocal samples
                watcher = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group)
                await watcher.start()
                try:
                    while True:
                        offsets = {tp.partition: (await watcher.committed(tp)) or 0 for tp in tps}
                        # Read the commit first, then Redis: a key still present now whose
                        # offset is below the commit was committed before it was deleted.
                        below = [k for (part, off), k in where.items() if off < offsets[part]]
                        with contextlib.suppress(Exception):
                            if left := await existing(client, below):
                                violations.append(f"committed {offsets} but {left[:3]} remain")
                            samples += 1
                        await asyncio.sleep(0.02)
                finally:
                    await watcher.stop()

            watch = asyncio.create_task(check_commits_follow_deletes())
            await asyncio.sleep(0.3)  # a few samples while Redis is still down
            server.start()
            recovered = time.monotonic()
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, group, tps, 200), timeout=15
            )
            print(f"backlog of 100 events done {time.monotonic() - recovered:.2f}s after restart")
            for start in range(200, 300, 10):  # live traffic while the watcher keeps checking
                await produce(range(start, start + 10))
                await asyncio.sleep(0.05)
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, group, tps, 300), timeout=15
            )
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        assert not violations, violations[:3]
        assert samples >= 5
        every = [key(i) for i in range(300)]
        names = [n for k in every for n in (k, lease_name(k), *replica_names(k, 8))]
        assert await existing(client, names) == []
        await client.aclose()


async def committed_total(
    bootstrap: str, group: str, tps: list[TopicPartition], expected: int
) -> bool:
    try:
        return sum((await committed(bootstrap, group, tps)).values()) >= expected
    except TimeoutError:
        return False  # the broker was slow to answer: eventually() asks again


async def test_two_daemons_share_partitions_and_a_rebalance_loses_nothing(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
) -> None:
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    await create_topic(kafka_bootstrap, unique_topic, 4)
    tps = [TopicPartition(unique_topic, p) for p in range(4)]
    keys = [f"{prefix}book:{i}" for i in range(20_000)]
    await seed(redis_client, keys)
    first, second = Daemon(config), Daemon(config)
    produced = 0
    quiet = asyncio.Event()

    async with producer(kafka_bootstrap) as p:

        async def traffic() -> None:
            """50 events every 50 ms until told to stop: both rebalances happen mid-stream."""
            nonlocal produced
            while not quiet.is_set():
                for i in range(produced, produced + 50):
                    await p.send(unique_topic, price_changed(i), partition=i % 4)
                produced += 50
                await asyncio.sleep(0.05)
            await p.flush()

        async with running(first):
            flow = asyncio.create_task(traffic())
            async with running(second):
                both = await eventually(
                    lambda: (
                        bool(first.assignment)
                        and bool(second.assignment)
                        and len(first.assignment | second.assignment) == 4
                    ),
                    timeout=15,
                )
                assert both, (first.assignment, second.assignment)
                assert not first.assignment & second.assignment
                assert await eventually(lambda: second.stats.batches >= 2, timeout=10)
            # `second` left the group gracefully: `first` takes every partition back.
            assert await eventually(lambda: len(first.assignment) == 4, timeout=15)
            assert await eventually(lambda: first.stats.batches >= 3, timeout=10)
            quiet.set()
            await flow
            assert not flow.exception()
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, config.kafka.group_id, tps, produced),
                timeout=20,
            )
    assert await existing(redis_client, keys[:produced]) == []
    assert first.stats.events > 0 and second.stats.events > 0
    assert first.stats.events + second.stats.events >= produced  # duplicates allowed, no gaps
    print(f"produced {produced}, processed {first.stats.events}+{second.stats.events}")


def write_config(path: Path, config: Config, namespaces_toml: str) -> Path:
    """The daemon's TOML, as an operator would write it (the subprocess loads it)."""
    kafka = config.kafka
    path.write_text(
        f"""
[redis]
url = "{config.redis.url}"
prefix = "{config.redis.prefix}"

[kafka]
bootstrap_servers = "{kafka.bootstrap_servers}"
topics = {msgspec.json.encode(kafka.topics).decode()}
group_id = "{kafka.group_id}"
dead_letter_topic = "{kafka.dead_letter_topic}"
max_batch = {kafka.max_batch}
session_timeout = {kafka.session_timeout}
heartbeat_interval = {kafka.heartbeat_interval}
rebalance_timeout = {kafka.rebalance_timeout}
retry_max_backoff = "200ms"
health_port = -1

[logging]
format = "json"

{namespaces_toml}

[[events]]
type = "BookPriceChanged"
invalidate = [{{ namespace = "book", key = {{ id = "book_id" }} }}]
"""
    )
    return path


@contextlib.contextmanager
def daemon_process(config_path: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "consumers", "--config", str(config_path)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def logged(log: Path, event: str) -> list[dict[str, Any]]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return [entry for line in lines if (entry := msgspec.json.decode(line)).get("event") == event]


async def test_sigkill_mid_stream_then_restart_loses_no_event(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    total = 10_000
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, max_batch=200)
    path = write_config(
        tmp_path / "layered_cache.toml",
        config,
        '[namespaces.book]\nkey = "book:{id}"\nhot = { replicas = 2 }',
    )
    await create_topic(kafka_bootstrap, unique_topic, 4)
    tps = [TopicPartition(unique_topic, p) for p in range(4)]
    keys = [f"{prefix}book:{i}" for i in range(total)]
    await seed(redis_client, keys)

    async def left() -> int:
        return int(await redis_client.exists(*keys))

    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    async with producer(kafka_bootstrap) as p:

        async def produce() -> None:
            """10,000 events over ~1 s, round-robin over 4 partitions."""
            for start in range(0, total, 500):
                for i in range(start, start + 500):
                    await p.send(unique_topic, price_changed(i), partition=i % 4)
                await asyncio.sleep(0.05)
            await p.flush()

        with daemon_process(path, first_log) as first:
            assert await eventually(
                lambda: bool(logged(first_log, "partitions_assigned")) and first.poll() is None,
                timeout=20,
            )
            flow = asyncio.create_task(produce())
            assert await eventually(lambda: _deleted_at_least(left, total, 2_000), timeout=20)
            first.send_signal(signal.SIGKILL)
            first.wait()
            remaining_at_kill = await left()
        assert remaining_at_kill > 0, "the first daemon finished before the kill"
        with daemon_process(path, second_log) as second:
            await flow
            assert await eventually(lambda: _deleted_at_least(left, total, total), timeout=40)
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, config.kafka.group_id, tps, total),
                timeout=20,
            )
            second.send_signal(signal.SIGTERM)  # graceful: finish, commit, leave, exit 0
            assert second.wait(timeout=20) == 0
    assert await left() == 0
    # Every key deleted and every offset committed are the outcome. The logged counts are
    # only reported: SIGKILL can take the first daemon's last log lines with it (a batch
    # done and committed whose "batch_done" line was still buffered; CI saw 2,400 + 7,500).
    first_events = sum(e["events"] for e in logged(first_log, "batch_done"))
    second_events = sum(e["events"] for e in logged(second_log, "batch_done"))
    assert logged(second_log, "daemon_stopped")
    print(
        f"killed with {remaining_at_kill} keys left; events logged {first_events} + "
        f"{second_events} = {first_events + second_events} (duplicates "
        f"{first_events + second_events - total})"
    )


async def _deleted_at_least(left: Any, total: int, count: int) -> bool:
    return bool(total - await left() >= count)


def test_kafka_security_settings_are_passed_through() -> None:
    from layered_cache._config import KafkaConfig
    from layered_cache.daemon.kafka import consumer_kwargs, producer_kwargs

    kafka = KafkaConfig(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="cache",
        sasl_password="s3cret",
    )
    for kwargs in (consumer_kwargs(kafka), producer_kwargs(kafka)):
        assert kwargs["security_protocol"] == "SASL_PLAINTEXT"
        assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
        assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("cache", "s3cret")
    assert consumer_kwargs(kafka)["enable_auto_commit"] is False
    tls = consumer_kwargs(KafkaConfig(security_protocol="SSL"))
    assert tls["ssl_context"] is not None


def test_bad_config_exits_2_naming_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[kafka]\nmax_batch = "lots"\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "consumers", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "kafka.max_batch" in done.stderr
