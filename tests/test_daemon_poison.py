"""The daemon never crashes and never stalls on one message (issue 11), on the real broker.

Each scenario puts one kind of hostile message between valid events on one partition and
checks what an operator would: the valid events' keys are gone, the group's offset is
committed to the end, the message is on the dead-letter topic with a reason that names
the problem (or counted, for tombstones and records the DLQ refuses), and the daemon is
still running.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import structlog
from aiokafka.producer import message_accumulator
from aiokafka.producer import producer as producer_module
from aiokafka.record import default_records
from aiokafka.structs import TopicPartition
from confluent_kafka import Producer as RdKafkaProducer
from hypothesis import given, settings
from hypothesis import strategies as st

from layered_cache.daemon import Daemon, dlq
from layered_cache.daemon.dlq import REASON_BYTES, RECORD_BYTES, Poison, dead_letter_record
from tests.helpers import eventually
from tests.servers import KafkaBroker, create_topic
from tests.test_daemon import (
    committed,
    daemon_config,
    existing,
    price_changed,
    producer,
    read_all,
    running,
    seed,
)
from tests.test_daemon_readiness import prefer

pytestmark = pytest.mark.kafka

Message = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]  # key, value, headers


class Scenario:
    """One topic + DLQ, a daemon on it, and the keys of the valid events around the
    hostile message: ``book:1`` before it, ``book:2`` after it."""

    def __init__(self, redis_url: str, prefix: str, bootstrap: str, topic: str, **kafka: Any):
        self.config = daemon_config(redis_url, prefix, bootstrap, topic, **kafka)
        self.bootstrap = bootstrap
        self.topic = topic
        self.prefix = prefix
        self.tp = TopicPartition(topic, 0)

    async def setup(self, redis_client: aioredis.Redis) -> None:
        await create_topic(self.bootstrap, self.topic, 1)
        await create_topic(self.bootstrap, self.config.kafka.dead_letter_topic, 1)
        await seed(redis_client, [f"{self.prefix}book:{i}" for i in (1, 2)], replicas=8)

    async def produce(self, hostile: Sequence[Message]) -> int:
        """book:1, the hostile messages, book:2; returns how many were produced."""
        async with producer(self.bootstrap) as p:
            await p.send_and_wait(self.topic, price_changed(1), partition=0)
            for key, value, headers in hostile:
                await p.send_and_wait(
                    self.topic, value, key=key, headers=headers or None, partition=0
                )
            await p.send_and_wait(self.topic, price_changed(2), partition=0)
        return len(hostile) + 2

    async def settled(self, daemon: Daemon, redis_client: aioredis.Redis, total: int) -> None:
        """The partition moved past everything: keys gone, offset committed to the end."""

        async def done() -> bool:
            offsets = await committed(self.bootstrap, self.config.kafka.group_id, [self.tp])
            return offsets[0] >= total

        assert await eventually(done, timeout=20), daemon.stats
        keys = [f"{self.prefix}book:{i}" for i in (1, 2)]
        assert await existing(redis_client, keys) == []

    async def dead(self, count: int) -> list[Any]:
        return await read_all(self.bootstrap, self.config.kafka.dead_letter_topic, count)


async def dead_letter_one(
    scenario: Scenario, redis_client: aioredis.Redis, message: Message, **daemon_kwargs: Any
) -> tuple[Daemon, Any]:
    """Run the scenario with one hostile message; return the daemon and its DLQ record."""
    await scenario.setup(redis_client)
    daemon = Daemon(scenario.config, **daemon_kwargs)
    async with running(daemon):
        total = await scenario.produce([message])
        await scenario.settled(daemon, redis_client, total)
        assert await eventually(lambda: daemon.stats.dead_letters >= 1, timeout=10)
    (record,) = await scenario.dead(1)
    return daemon, record


def reason(record: Any) -> str:
    return str(dict(record.headers)["dlq.reason"].decode())


@pytest.fixture
def scenario(redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str) -> Scenario:
    return Scenario(redis_url, prefix, kafka_bootstrap, unique_topic)


# -- total decoding -----------------------------------------------------------------------


async def test_message_with_2000_nested_brackets_is_dead_lettered_and_partition_moves_on(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    daemon, record = await dead_letter_one(scenario, redis_client, (None, b"[" * 2000, []))
    assert "RecursionError" in reason(record)
    assert record.value == b"[" * 2000
    assert daemon.stats.events == 2


async def test_integer_of_5000_digits_is_dead_lettered_as_out_of_range_not_as_not_json(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    value = b'{"type": "BookPriceChanged", "book_id": ' + b"9" * 5000 + b"}"
    _, record = await dead_letter_one(scenario, redis_client, (b"k", value, []))
    text = reason(record)
    assert "not JSON" not in text
    assert "out of range" in text and "ValidationError" in text
    assert len(text.encode()) <= REASON_BYTES


# -- records that always fit ---------------------------------------------------------------


async def test_cache_invalidate_with_600_kb_namespace_is_dead_lettered_with_a_short_reason(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    namespace = "n" * 600_000
    value = msgspec.json.encode({"type": "CacheInvalidate", "namespace": namespace, "keys": []})
    _, record = await dead_letter_one(scenario, redis_client, (b"k", value, []))
    headers = dict(record.headers)
    assert len(headers["dlq.reason"]) <= REASON_BYTES
    assert "unknown namespace" in reason(record)
    assert record.value == value  # under max_event_bytes: kept whole
    assert "dlq.original.size" not in headers


async def test_poison_too_big_for_the_dlq_goes_there_truncated_with_its_origin(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    # Under max_event_bytes on its own, but key + headers + value exceed what one DLQ
    # record may carry (the old daemon retried MessageSizeTooLargeError forever).
    key = b"K" * 300_000
    headers = [("big", b"v" * 200_000)] + [(f"h{i}", b"v" * 20_000) for i in range(3)]
    value = b'{"type": "Nope", "pad": "' + b"x" * 960_000 + b'"}'
    _, record = await dead_letter_one(scenario, redis_client, (key, value, headers))
    got = dict(record.headers)
    size = len(record.key) + len(record.value) + sum(len(k) + len(v) for k, v in record.headers)
    assert size <= RECORD_BYTES
    assert int(got["dlq.original.size"]) == len(value)
    assert int(got["dlq.original.key.size"]) == len(key)
    assert int(got["dlq.original.headers.dropped"]) == 1  # the 200 KB one
    assert [k for k, _ in record.headers[:3]] == ["h0", "h1", "h2"]  # the others are kept
    assert got["dlq.original.topic"].decode() == scenario.topic
    assert got["dlq.original.partition"] == b"0"
    assert got["dlq.original.offset"] == b"1"
    assert value.startswith(record.value) and record.value


# -- tombstones ----------------------------------------------------------------------------


class _NotUtf8HeaderName(str):
    """A header name whose bytes on the wire are not UTF-8: Kafka's header names are
    opaque bytes, and a Go or C producer may write any. (aiokafka's pure-Python batch
    builder writes what ``encode`` returns.)"""

    def encode(self, *args: Any, **kwargs: Any) -> bytes:  # type: ignore[override]
        return b"\xff\xfe-bad"


def _unreadable_batches(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Make aiokafka's producer write the next batches the way ``how`` says; each is one
    a consumer cannot unpack. A broken CRC or codec is refused by Apache Kafka at
    produce time, but a broker that stores batches as they come (tansu) hands them on."""
    builder = default_records._DefaultRecordBatchBuilderPy
    for module in (message_accumulator, producer_module):
        monkeypatch.setattr(module, "DefaultRecordBatchBuilder", builder)
    if how == "crc":
        monkeypatch.setattr(default_records, "calc_crc32c", lambda data: 0xDEADBEEF)
    elif how in ("gzip", "zstd", "snappy-cut"):  # the attributes name a codec...
        bits = {"gzip": 1, "zstd": 4, "snappy-cut": 2}[how]
        original = builder._get_attributes
        monkeypatch.setattr(
            builder, "_get_attributes", lambda self, include=True: original(self, include) | bits
        )
    if how == "snappy-cut":  # ...and the body is snappy in xerial framing, cut short
        monkeypatch.setattr(builder, "_maybe_compress", _xerial_header_alone)


def _xerial_header_alone(self: Any) -> bool:
    """The batch's records replaced by a xerial snappy header and 2 bytes of the first
    block's length: aiokafka's ``snappy_decode`` raised ``struct.error``, which no list
    of the daemon's named: the daemon crashed, and every restart with it."""
    del self._buffer[self.HEADER_STRUCT.size :]
    self._buffer += b"\x82SNAPPY\x00" + struct.pack("!ii", 1, 1) + b"\x00\x00"
    return True  # compressed: the attributes name the codec


@pytest.mark.parametrize("how", ["crc", "gzip", "zstd", "snappy-cut"])
async def test_a_record_aiokafka_cannot_unpack_is_dead_lettered_and_the_partition_moves_on(
    scenario: Scenario, redis_client: aioredis.Redis, how: str
) -> None:
    """aiokafka unpacks records inside ``getmany``, for the whole fetch: the daemon
    crashed before seeing one record, and every restart crashed on the same one."""
    await scenario.setup(redis_client)
    daemon = Daemon(scenario.config)
    async with running(daemon), producer(scenario.bootstrap) as p:
        await p.send_and_wait(scenario.topic, price_changed(1), partition=0)
        with pytest.MonkeyPatch.context() as monkeypatch:
            _unreadable_batches(monkeypatch, how)
            await p.send_and_wait(scenario.topic, price_changed(3), partition=0)
        await p.send_and_wait(scenario.topic, price_changed(2), partition=0)
        await scenario.settled(daemon, redis_client, 3)  # book:1 and book:2 applied
    (record,) = await scenario.dead(1)
    assert "unreadable record (" in reason(record)
    if how == "snappy-cut":  # any error of decoding a batch is its record's
        assert "CorruptRecordException: struct.error while decoding" in reason(record)
    assert dict(record.headers)["dlq.original.offset"] == b"1"
    assert record.value == b""  # aiokafka handed over nothing to keep
    assert daemon.stats.events == 2


async def test_records_whose_header_names_are_not_utf8_are_read_with_the_rest_of_their_batch(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    """A Go or C producer batches records: [book:1, book:3 and a poison event each with a
    header name that is not UTF-8, book:2, book:4] is one batch on the wire. aiokafka
    decodes a batch from its first record at every fetch: the careful pass set the first
    bad record aside, sought past it, the next fetch raised again, and every later record
    of the batch was set aside as unreadable with no value, book:2 and book:4 never
    applied. Now such names are read: each record is applied or dead-lettered whole."""
    await scenario.setup(redis_client)
    keys = [f"{scenario.prefix}book:{i}" for i in (1, 2, 3, 4)]
    await seed(redis_client, keys, replicas=8)
    odd = [(_NotUtf8HeaderName("x"), b"v"), ("ok", b"w")]
    daemon = Daemon(scenario.config)
    async with running(daemon), producer(scenario.bootstrap) as p:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _unreadable_batches(monkeypatch, "header")  # the pure-Python batch builder
            batch = p.create_batch()
            for value, headers in [
                (price_changed(1), []),
                (price_changed(3), odd),
                (b"not json", odd),
                (price_changed(2), []),
                (price_changed(4), []),
            ]:
                appended = batch.append(key=b"k", value=value, timestamp=None, headers=headers)
                assert appended is not None
            batch.close()
            await (await p.send_batch(batch, scenario.topic, partition=0))

        async def moved_on() -> bool:
            at = await committed(scenario.bootstrap, scenario.config.kafka.group_id, [scenario.tp])
            return at[0] >= 5

        assert await eventually(moved_on, timeout=30), daemon.stats
    assert await existing(redis_client, keys) == []
    assert (daemon.stats.events, daemon.stats.dead_letters) == (4, 1), daemon.stats
    (record,) = await scenario.dead(1)
    assert dict(record.headers)["dlq.original.offset"] == b"2"
    assert (record.key, record.value) == (b"k", b"not json")
    assert list(record.headers[:2]) == [("\\xff\\xfe-bad", b"v"), ("ok", b"w")]  # name's bytes escaped


async def test_tombstones_are_counted_and_skipped_not_dead_lettered(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    await scenario.setup(redis_client)
    daemon = Daemon(scenario.config, health_port=0)
    async with running(daemon):
        total = await scenario.produce([(b"book-7", None, []), (b"book-8", None, [("h", b"1")])])
        await scenario.settled(daemon, redis_client, total)
        assert daemon.health is not None and daemon.health.bound_port
        text = daemon.metrics.render().decode()
    assert daemon.stats.tombstones == 2
    assert daemon.stats.dead_letters == 0 and daemon.stats.events == 2
    assert "layered_cache_daemon_tombstones_total 2.0" in text
    assert await scenario.dead(0) == []


async def test_message_with_neither_key_nor_value_is_skipped_and_partition_moves_on(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    """aiokafka can't produce it (it asserts); librdkafka can, and so can other clients.
    The old daemon dead-lettered it and crashed on aiokafka's assert."""
    await scenario.setup(redis_client)
    daemon = Daemon(scenario.config)
    async with running(daemon):
        rd = RdKafkaProducer({"bootstrap.servers": scenario.bootstrap})
        rd.produce(scenario.topic, value=price_changed(1), partition=0)
        rd.produce(scenario.topic, partition=0)  # neither key nor value
        rd.produce(scenario.topic, value=price_changed(2), partition=0)
        assert rd.flush(10) == 0
        await scenario.settled(daemon, redis_client, 3)
    assert daemon.stats.tombstones == 1 and daemon.stats.events == 2


# -- retries only for transient failures ----------------------------------------------------


async def test_dead_letter_refused_for_good_is_set_aside_counted_and_partition_moves_on(
    scenario: Scenario, redis_client: aioredis.Redis
) -> None:
    # A producer limit below the record's size: aiokafka raises MessageSizeTooLargeError,
    # which no retry fixes (the old daemon retried it forever, committing nothing).
    await scenario.setup(redis_client)
    daemon = Daemon(scenario.config, producer_options={"max_request_size": 50_000})
    value = b'{"type": "Nope", "pad": "' + b"x" * 100_000 + b'"}'
    with structlog.testing.capture_logs() as logs:
        async with running(daemon):
            total = await scenario.produce([(None, value, []), (None, b"not json", [])])
            await scenario.settled(daemon, redis_client, total)
            assert await eventually(lambda: daemon.stats.dead_letters >= 1, timeout=10)
            text = daemon.metrics.render().decode()
    assert daemon.stats.dead_letters_rejected == 1
    assert daemon.stats.dead_letters == 1  # the small one still made it
    assert "layered_cache_daemon_dead_letters_rejected_total 1.0" in text
    (skipped,) = [e for e in logs if e["event"] == "dead_letter_rejected_skipped"]
    assert "MessageSizeTooLargeError" in skipped["error"] and skipped["offset"] == 1
    (record,) = await scenario.dead(1)
    assert record.value == b"not json"


class _ValidatingBroker(KafkaBroker):
    """tansu validating the dead-letter topic's values against a JSON schema (values must
    be JSON objects): a value that is not is refused with INVALID_RECORD (87)."""

    def __init__(self, dead_letter_topic: str) -> None:
        super().__init__()
        schemas = self.dir / "schema"
        schemas.mkdir()
        (schemas / f"{dead_letter_topic}.json").write_text(
            '{"type": "object", "properties": {"value": {"type": "object"}}}'
        )

    def command(self) -> list[str]:
        # tansu resolves a file:// registry under its working directory (self.dir).
        return [*super().command(), "--schema-registry", "file:///schema"]


async def test_a_dead_letter_the_broker_refuses_as_invalid_is_set_aside_and_the_partition_moves_on(
    redis_url: str,
    prefix: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Brokers answer INVALID_RECORD (87) for a record they refuse for good (a null key on
    a compacted topic, a value failing broker-side schema validation). aiokafka has no
    class for it: ``UnknownError``, which was retried as transient for ever, the
    partition never committed again. The other dead letter of the batch, one the broker
    accepts, is still written (the broker refused the request they shared)."""
    monkeypatch.setattr(dlq, "UNKNOWN_FOR", 0.5)  # refused for good after 0.5 s, not 30
    with _ValidatingBroker(f"{unique_topic}.dlq") as broker:
        await create_topic(broker.bootstrap, unique_topic, 1)
        config = daemon_config(redis_url, prefix, broker.bootstrap, unique_topic)
        keys = [f"{prefix}book:{i}" for i in (1, 2)]
        await seed(redis_client, keys)
        tp = TopicPartition(unique_topic, 0)
        daemon = Daemon(config)
        async with running(daemon), producer(broker.bootstrap) as p:
            for value in (price_changed(1), b"not json", b'{"type": "Nope"}', price_changed(2)):
                await p.send(unique_topic, value, partition=0)
            await p.flush()

            async def moved_on() -> bool:
                return (await committed(broker.bootstrap, config.kafka.group_id, [tp]))[0] >= 4

            assert await eventually(moved_on, timeout=20), daemon.stats
        dead = await read_all(broker.bootstrap, config.kafka.dead_letter_topic, 1)
    assert (daemon.stats.dead_letters_rejected, daemon.stats.dead_letters) == (1, 1)
    assert [record.value for record in dead] == [b'{"type": "Nope"}']
    assert await existing(redis_client, keys) == []


# -- compression codecs --------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
async def test_events_compressed_by_librdkafka_with_each_codec_are_applied(
    codec: str,
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
) -> None:
    """snappy, lz4 and zstd need cramjam (a runtime dependency): without it the old
    daemon died with UnsupportedCodecError on the first such batch."""
    scenario = Scenario(redis_url, prefix, kafka_bootstrap, unique_topic)
    await scenario.setup(redis_client)
    keys = [f"{prefix}book:{i}" for i in range(100, 150)]
    await seed(redis_client, keys)
    daemon = Daemon(scenario.config)
    async with running(daemon):
        rd = RdKafkaProducer(
            {"bootstrap.servers": kafka_bootstrap, "compression.type": codec, "linger.ms": 20}
        )
        for i in range(100, 150):
            rd.produce(
                unique_topic,
                value=price_changed(i),
                key=f"book-{i}".encode(),
                headers=[("trace-id", f"t{i}".encode()), ("source", b"catalog")],
                partition=0,
            )
        rd.produce(unique_topic, value=b"{not json", key=b"bad", headers=[("h", b"1")], partition=0)
        assert rd.flush(10) == 0

        async def done() -> bool:
            offsets = await committed(kafka_bootstrap, scenario.config.kafka.group_id, [scenario.tp])
            return offsets[0] >= 51

        assert await eventually(done, timeout=20), daemon.stats
    assert await existing(redis_client, keys) == []
    assert daemon.stats.events == 50 and daemon.stats.dead_letters == 1
    (record,) = await scenario.dead(1)
    assert record.key == b"bad" and dict(record.headers)["h"] == b"1"


# -- the DLQ record builder, over every size ------------------------------------------------


@given(
    key=st.none() | st.integers(0, 200_000).map(lambda n: b"k" * n),
    value=st.none() | st.integers(0, 3_000_000).map(lambda n: b"v" * n),
    headers=st.lists(
        st.tuples(st.text(max_size=300), st.none() | st.integers(0, 300_000).map(lambda n: b"h" * n)),
        max_size=6,
    ),
    reason=st.text(max_size=700_000),
    event_type=st.none() | st.text(max_size=700_000),
)
@settings(max_examples=150, deadline=None)
def test_every_dead_letter_record_fits_and_has_a_value(
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, bytes | None]],
    reason: str,
    event_type: str | None,
) -> None:
    """Whatever a poison message carries, its DLQ copy is under the record budget and has
    a value (aiokafka asserts ``not (value is None and key is None)``)."""
    poison = Poison("t" * 249, 7, 2**40, 2**41, key, value, tuple(headers), reason, event_type)  # type: ignore[arg-type]
    out_key, out_value, out_headers = dead_letter_record(poison, 1_000_000)
    assert out_value is not None
    size = len(out_key or b"") + len(out_value)
    size += sum(len(name.encode()) + len(v or b"") + 8 for name, v in out_headers)
    assert size <= RECORD_BYTES
    got = dict(out_headers)
    assert len(got["dlq.reason"]) <= REASON_BYTES
    assert got["dlq.original.offset"] == str(2**40).encode()
    if value is not None and len(out_value) < len(value):
        assert int(got["dlq.original.size"]) == len(value)


async def test_an_unreadable_record_on_one_partition_loses_nothing_fetched_for_the_others(
    redis_url: str, prefix: str, kafka_bootstrap: str, redis_client: aioredis.Redis
) -> None:
    """aiokafka drains a fetch partition by partition, moving each one's position past
    the records it collected, and drops them all when one partition raises: the careful
    pass then read the partitions drained before the bad one from their moved positions,
    and the next batches committed past events never applied. Which partitions come
    first depends on the fetch's order (per topic name): a few fresh topics make it
    certain to be hit."""
    import uuid

    for _ in range(3):
        topic = f"unreadable-{uuid.uuid4().hex[:8]}"
        config = daemon_config(redis_url, prefix, kafka_bootstrap, topic)
        await create_topic(kafka_bootstrap, topic, 4)
        await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
        good = {part: [part * 100 + i for i in range(5)] for part in range(3)}
        keys = [f"{prefix}book:{b}" for books in good.values() for b in books]
        await seed(redis_client, keys, replicas=8)
        async with producer(kafka_bootstrap) as p:
            for part, books in good.items():
                for book in books:
                    await p.send_and_wait(topic, price_changed(book), partition=part)
            with pytest.MonkeyPatch.context() as monkeypatch:
                _unreadable_batches(monkeypatch, "crc")
                await p.send_and_wait(topic, price_changed(999), partition=3)
            await p.send_and_wait(topic, price_changed(998), partition=3)
        daemon = Daemon(config)
        tps = [TopicPartition(topic, part) for part in range(4)]
        async with running(daemon):
            async with producer(kafka_bootstrap) as p:  # one more event per good partition
                for part in good:
                    await p.send_and_wait(topic, price_changed(part * 100 + 50), partition=part)

            async def settled() -> bool:
                offsets = await committed(kafka_bootstrap, config.kafka.group_id, tps)
                return offsets == {0: 6, 1: 6, 2: 6, 3: 2}

            assert await eventually(settled, timeout=30), daemon.stats
        assert await existing(redis_client, keys) == []  # committed to the end: all applied


async def test_a_stop_during_the_careful_pass_commits_nothing_past_what_it_abandoned(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poison event P (offset 0), then a record aiokafka can't unpack U (offset 1): the
    careful pass handles P alone, its dead-letter write fails for the moment and is
    retried, SIGTERM comes, P's batch is abandoned uncommitted - and the pass read on,
    set U aside and committed offset 2, past P, never dead-lettered."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaTimeoutError

    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    async with producer(kafka_bootstrap) as p:
        await p.send_and_wait(unique_topic, b"not json", partition=0)  # P
        with pytest.MonkeyPatch.context() as mp:
            _unreadable_batches(mp, "crc")
            await p.send_and_wait(unique_topic, price_changed(9), partition=0)  # U
    real_send = AIOKafkaProducer.send

    async def dead_letters_of_p_fail(
        self: Any, topic: str, value: Any = None, key: Any = None, partition: Any = None,
        timestamp_ms: Any = None, headers: Any = None,
    ) -> Any:
        reason = dict(headers or []).get("dlq.reason", b"")
        if topic == config.kafka.dead_letter_topic and not reason.startswith(b"unreadable"):
            raise KafkaTimeoutError("the dead-letter topic is not writable for now")
        return await real_send(self, topic, value=value, key=key, partition=partition,
                               timestamp_ms=timestamp_ms, headers=headers)

    monkeypatch.setattr(AIOKafkaProducer, "send", dead_letters_of_p_fail)
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.run())
    try:
        assert await eventually(lambda: daemon._retrier.retrying == "dead_letter", timeout=30)
    finally:
        daemon.stop()  # SIGTERM
        await asyncio.wait_for(task, 30)
    monkeypatch.undo()
    tp = TopicPartition(unique_topic, 0)
    assert (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] == 0




class _DeadLetterOutage:
    """The dead-letter topic times out (a failure that may pass: retried) until ``end()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, topic: str) -> None:
        from aiokafka import AIOKafkaProducer
        from aiokafka.errors import KafkaTimeoutError

        self.down = True
        real_send = AIOKafkaProducer.send

        async def send(producer: Any, to: str, *args: Any, **kwargs: Any) -> Any:
            if self.down and to == topic:
                raise KafkaTimeoutError("the dead-letter topic is not writable for now")
            return await real_send(producer, to, *args, **kwargs)

        monkeypatch.setattr(AIOKafkaProducer, "send", send)

    def end(self) -> None:
        self.down = False


async def _unreadable_on_p0(bootstrap: str, topic: str) -> None:
    async with producer(bootstrap) as p:
        with pytest.MonkeyPatch.context() as mp:
            _unreadable_batches(mp, "crc")
            await p.send_and_wait(topic, price_changed(1), partition=0)


async def test_sigterm_during_the_careful_pass_stops_it_within_a_record(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/daemon.md (Shutdown): SIGTERM finishes the batch in flight and exits. The
    careful pass never looked at stop(): after it, it read on one record at a time
    through up to ``max_batch`` records of every partition (here ~1,000 batches), the
    partitions held and /readyz 503 meanwhile - under a 30 s grace period, SIGKILL."""
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    await create_topic(kafka_bootstrap, unique_topic, 2)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    await _unreadable_on_p0(kafka_bootstrap, unique_topic)
    outage = _DeadLetterOutage(monkeypatch, config.kafka.dead_letter_topic)
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.run())
    try:  # the careful pass holds at p0's record while p1 gets a backlog
        assert await eventually(lambda: daemon._retrier.retrying == "dead_letter", timeout=30)
        async with producer(kafka_bootstrap) as p:
            sent = [await p.send(unique_topic, price_changed(i), partition=1) for i in range(2000)]
            await asyncio.gather(*sent)
        outage.end()  # p0's record set aside: the pass reads p1, a record per batch
        assert await eventually(lambda: daemon.stats.events >= 10, timeout=30)
        before = daemon.stats.batches
        daemon.stop()  # SIGTERM
        await asyncio.wait_for(task, 30)
    finally:
        daemon.stop()
        await asyncio.gather(task, return_exceptions=True)
    assert daemon.stats.batches - before <= 1  # at most the record in flight
    tps = [TopicPartition(unique_topic, part) for part in (0, 1)]
    offsets = await committed(kafka_bootstrap, config.kafka.group_id, tps)
    assert offsets[0] == 1  # the unreadable record set aside
    assert offsets[1] == daemon.stats.events < 2000  # what was applied, nothing past it


async def test_a_set_aside_whose_partition_moves_is_given_up_and_the_new_partition_is_read(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/daemon.md: a record the careful pass can't finish (revoked, its dead-letter
    abandoned) ends it uncommitted; DESIGN: the daemon never crashes or stalls on one
    message. The set-aside of an unreadable record was not "in flight" for the
    rebalance listener: A kept retrying its dead-letter write for p0, which B now
    owned, never reading the p1 it got, and when the DLQ came back its seek on p0
    raised IllegalStateError out of run() (exit 1)."""
    config_a = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic,
                             client_id="zz-daemon-a")
    # B sorts first (member ids start with the client id): the range assignor gives it p0.
    config_b = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic,
                             group=config_a.kafka.group_id, client_id="aa-daemon-b")
    await create_topic(kafka_bootstrap, unique_topic, 2)
    await create_topic(kafka_bootstrap, config_a.kafka.dead_letter_topic, 1)
    await seed(redis_client, [f"{prefix}book:11"], replicas=8)
    await _unreadable_on_p0(kafka_bootstrap, unique_topic)
    outage = _DeadLetterOutage(monkeypatch, config_a.kafka.dead_letter_topic)
    a = Daemon(config_a)
    task_a = asyncio.create_task(a.run())
    p0, p1 = TopicPartition(unique_topic, 0), TopicPartition(unique_topic, 1)

    async def moved_past_both() -> bool:
        offsets = await committed(kafka_bootstrap, config_a.kafka.group_id, [p0, p1])
        return offsets == {0: 1, 1: 1}

    try:
        assert await eventually(lambda: a._retrier.retrying == "dead_letter", timeout=30)
        async with running(Daemon(config_b)) as b:  # a second daemon joins: rebalance
            assert await eventually(lambda: b.assignment == {p0}, timeout=30), b.assignment
            assert await eventually(lambda: a.assignment == {p1}, timeout=30), a.assignment
            async with producer(kafka_bootstrap) as p:
                await p.send_and_wait(unique_topic, price_changed(11), partition=1)

            async def applied() -> bool:
                return await existing(redis_client, [f"{prefix}book:11"]) == []

            assert await eventually(applied, timeout=15), "A never read its p1"
            outage.end()  # B, p0's owner now, sets the record aside
            assert await eventually(moved_past_both, timeout=30), (a.stats, b.stats)
            assert not task_a.done()
    finally:
        a.stop()
        await asyncio.gather(asyncio.wait_for(task_a, 30), return_exceptions=True)
    task_a.result()  # run() returned, it did not raise
    dead = await read_all(kafka_bootstrap, config_a.kafka.dead_letter_topic, 1)
    assert [dict(r.headers)["dlq.original.offset"] for r in dead][:1] == [b"0"]


class _LateDeadLetterAck:
    """The first dead-letter record is written at once; its writer sees the broker's
    ack only after ``release()`` (a slow acknowledgement, the record already stored)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, topic: str) -> None:
        from aiokafka import AIOKafkaProducer

        self.held = False
        self._released = asyncio.Event()
        real_send = AIOKafkaProducer.send

        async def send(producer: Any, to: str, *args: Any, **kwargs: Any) -> Any:
            ack = await real_send(producer, to, *args, **kwargs)
            if to != topic or self.held:
                return ack
            self.held = True

            async def late() -> Any:
                await self._released.wait()
                return await ack

            return asyncio.ensure_future(late())

        monkeypatch.setattr(AIOKafkaProducer, "send", send)

    def release(self) -> None:
        self._released.set()


async def test_a_dead_letter_written_as_its_partition_moves_is_written_again_by_its_new_owner(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/daemon.md: the dead-letter topic is at-least-once. A's copy of a poison event
    is stored, but the ack comes after B took the partition over (A's wait for its batch,
    half the rebalance timeout, ran out). A's commit is refused, B reads the event again
    and writes it again: two copies with the same origin headers, which is how a reader
    tells them apart. The partition moves past the event; nothing is lost."""
    group = f"g-dup-{prefix.rstrip(':')}"

    def make(tag: bytes) -> Daemon:
        config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, group=group)
        options = {"partition_assignment_strategy": (prefer(tag),)}
        return Daemon(config, consumer_options=options)

    a, b = make(b"A"), make(b"B")
    dlq = a.config.kafka.dead_letter_topic
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, dlq, 1)
    late = _LateDeadLetterAck(monkeypatch, dlq)
    source = TopicPartition(unique_topic, 0)
    async with running(a), producer(kafka_bootstrap) as p:
        await p.send_and_wait(unique_topic, b"not json")
        assert await eventually(lambda: late.held, timeout=15)
        async with running(b):  # joins; the test's assignor gives B every partition
            assert await eventually(lambda: not a.assignment, timeout=30)
            assert await eventually(lambda: b.stats.dead_letters == 1, timeout=15)
            late.release()
            assert await eventually(lambda: a.stats.dead_letters == 1, timeout=10)
            assert a.stats.commit_failures >= 1  # A's commit: the partition is B's
    dead = await read_all(kafka_bootstrap, dlq, 3, timeout=5)
    origins = [
        tuple(dict(r.headers)[f"dlq.original.{h}"] for h in ("topic", "partition", "offset"))
        for r in dead
    ]
    assert origins == [(unique_topic.encode(), b"0", b"0")] * 2
    assert await committed(kafka_bootstrap, group, [source]) == {0: 1}
