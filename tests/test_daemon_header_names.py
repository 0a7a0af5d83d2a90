"""The daemon's lenient reading of header names (``daemon/header_names``) where aiokafka
is not what it expects: a legacy message set (magic 0/1), and an aiokafka without the
private classes it reads with. Each crashed or stopped the daemon (found by a review of
the hook, 2026-12-05); each must read as aiokafka reads, unhooked."""

from __future__ import annotations

import subprocess
import sys

from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED, PartitionRecords
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.structs import TopicPartition

from layered_cache.daemon.header_names import lenient_fetches

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


def _values(records: object) -> list[bytes]:
    tp = TopicPartition("catalog-events", 0)
    unpacked = PartitionRecords(tp, records, None, 0, None, None, True, READ_UNCOMMITTED)
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
