"""The daemon's lenient reading of header names (``daemon/header_names``) where aiokafka
is not what it expects: a legacy message set (magic 0/1), and an aiokafka without the
private classes it reads with. Each crashed or stopped the daemon (found by a review of
the hook, 2026-12-05); each must read as aiokafka reads, unhooked. And where the record
read leniently is malformed past its header name: it is set aside, the process lives."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED, PartitionRecords
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.structs import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from layered_cache.daemon.header_names import lenient_fetches
from layered_cache.daemon.unreadable import UNREADABLE
from tests.helpers import eventually
from tests.raw_batches import batch, record, send_raw
from tests.servers import create_topic
from tests.test_daemon import (
    ROOT,
    committed,
    daemon_config,
    daemon_process,
    existing,
    logged,
    price_changed,
    producer,
    seed,
    write_config,
)

# A later aiokafka's layout: its private pure-Python record classes gone.
_SCRIPT = """
import aiokafka.record.default_records as records
del records._DefaultRecordBatchPy, records._DefaultRecordPy
import layered_cache.daemon
from layered_cache.daemon.kafka import KafkaClients
from layered_cache.daemon.header_names import lenient_fetches
with lenient_fetches():
    pass
print("ok")
"""


def _legacy_message_set() -> bytes:
    builder = LegacyRecordBatchBuilder(magic=1, compression_type=0, batch_size=1 << 20)
    for offset in range(3):
        builder.append(offset, timestamp=1_700_000_000_000, key=None, value=b"v%d" % offset)
    return bytes(builder.build())


def _values(records: object, check_crcs: bool = True) -> list[bytes]:
    tp = TopicPartition("catalog-events", 0)
    unpacked = PartitionRecords(tp, records, None, 0, None, None, check_crcs, READ_UNCOMMITTED)
    return [record.value for record in unpacked]


def test_a_legacy_message_set_reads_the_same_through_the_daemons_consumer() -> None:
    data = _legacy_message_set()
    plain = _values(fetcher.MemoryRecords(data))  # aiokafka's own reading (or ours, unhooked)
    with lenient_fetches():  # as around the daemon's consumer.start(): its fetch task's
        hooked = _values(fetcher.MemoryRecords(data))
    assert plain == [b"v0", b"v1", b"v2"]
    assert hooked == plain


def test_the_daemon_imports_and_runs_unhooked_without_aiokafkas_private_record_classes(
) -> None:
    """...and says so at each start: the defence is off (it was silent)."""
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines[-1:] == ["ok"], done.stderr[-600:]
    assert "kafka_header_names_strict" in done.stdout + done.stderr, done.stdout


# -- malformed past a header name that is not UTF-8 ---------------------------------------

_BATCH_HEADER = 61  # a v2 batch's bytes before its first record
_ODD_NAMES = batch(
    [
        record(0, b"k", b"v0", [(b"\xff", b"v"), (b"ok", b"w")]),  # read leniently from here
        record(1, None, b"v1", [(b"a", None), (b"\xfe\xff", b"")]),
        record(2, b"", None, []),
    ]
)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_record_with_a_non_utf8_header_name_and_a_corrupt_header_length_is_set_aside(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Header 1's name b"\\xff" (aiokafka's C reader stops there: the record is read again
    in Python), header 2's value length 2**40 with nothing behind it. The re-read used
    aiokafka's Cython ``decode_varint``, which has no bounds check: the position went
    2**40 bytes past the buffer, and the next read killed the daemon (SIGSEGV), again at
    every restart. Now the record is set aside as unreadable and the partition moves on."""
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    path = write_config(tmp_path / "layered_cache.toml", config, '[namespaces.book]\nkey = "book:{id}"')
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    tp = TopicPartition(unique_topic, 0)
    keys = [f"{prefix}book:{i}" for i in (1, 2)]
    await seed(redis_client, keys)
    evil = batch([record(0, None, b"{}", [(b"\xff", b"v"), (b"a", 1 << 40), (b"x", b"y")])])
    log = tmp_path / "daemon.log"
    with daemon_process(path, log) as proc:
        assert await eventually(lambda: bool(logged(log, "partitions_assigned")), timeout=30)
        async with producer(kafka_bootstrap) as p:
            await p.send_and_wait(unique_topic, price_changed(1), partition=0)
            await send_raw(p, unique_topic, 0, evil)
            await p.send_and_wait(unique_topic, price_changed(2), partition=0)

        async def moved_on() -> bool:
            if proc.poll() is not None:
                return True
            return (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] >= 3

        await eventually(moved_on, timeout=30, interval=0.2)
        assert proc.poll() is None, f"daemon died ({proc.poll()}): {log.read_text()[-600:]}"
        assert (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] >= 3
        assert await existing(redis_client, keys) == []
        (aside,) = logged(log, "unreadable_record_set_aside")
        assert aside["offset"] == 1 and "CorruptRecordException" in aside["error"], aside
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


@settings(max_examples=3000, deadline=None, database=None)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(_ODD_NAMES) - _BATCH_HEADER), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
    cut=st.integers(0, 12),
    grow=st.binary(max_size=12),
)
def fuzz_the_lenient_reading(edits: list[tuple[int, int]], cut: int, grow: bytes) -> None:
    """A batch whose records are read leniently, bytes of its records changed, cut off or
    added (its length field kept right, so it is read; CRCs not checked, so the bytes
    reach the record reader): each read ends in records or an error the daemon sets
    aside. Run by the test below in a process of its own: a crash is its exit code."""
    data = bytearray(_ODD_NAMES)
    for at, byte in edits:
        if _BATCH_HEADER + at < len(data):
            data[_BATCH_HEADER + at] = byte
    data = data[: len(data) - cut] + grow
    data[8:12] = (len(data) - 12).to_bytes(4, "big")
    with lenient_fetches():
        records = fetcher.MemoryRecords(bytes(data))
    with contextlib.suppress(UNREADABLE):
        _values(records, check_crcs=False)


def test_no_malformed_record_read_leniently_crashes_the_process() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import tests.test_daemon_header_names as t; "
         "t.fuzz_the_lenient_reading()"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"


def test_the_lenient_reading_reads_what_aiokafka_reads_but_the_names() -> None:
    """The bounded reader reads a well-formed batch whole: every record, key and value
    (the fuzz above would pass a reader that sets every record aside)."""
    with lenient_fetches():
        hooked = _values(fetcher.MemoryRecords(_ODD_NAMES))
    assert hooked == [b"v0", b"v1", None]
