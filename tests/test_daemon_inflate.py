"""Compressed batches decompressed within a cap (``daemon/inflate``): a batch that would
inflate past it is set aside as unreadable, whatever its codec, and one within it reads
as aiokafka reads it. aiokafka decompresses a whole batch in memory inside ``getmany``:
a 256 KiB zstd batch that inflates to 8 GiB killed the daemon, at every restart."""

from __future__ import annotations

import os
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import cramjam
import pytest
import redis.asyncio as aioredis
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED, PartitionRecords
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import TopicPartition

from layered_cache.daemon.header_names import lenient_fetches
from tests.helpers import eventually
from tests.raw_batches import batch, record, send_raw, zstd_rle_bomb
from tests.servers import create_topic
from tests.test_daemon import (
    ROOT,
    committed,
    daemon_config,
    existing,
    logged,
    price_changed,
    producer,
    seed,
    write_config,
)

CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
_ADDRESS_SPACE = 3 << 30  # the daemon runs in 3 GiB of address space (a container's limit)


def _compressed(codec: int, values: list[bytes]) -> bytes:
    """A batch as aiokafka's producer writes it with ``codec``."""
    builder = DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, batch_size=64 << 20)
    for offset, value in enumerate(values):
        builder.append(offset, timestamp=1_700_000_000_000, key=b"k", value=value, headers=[])
    return bytes(builder.build())


def _read(data: bytes, cap: int | None) -> list[bytes | None]:
    """The values the fetcher unpacks from ``data``: by aiokafka alone (``cap`` None) or
    through the daemon's consumer's hook, decompressing within ``cap``."""
    if cap is None:
        records = fetcher.MemoryRecords(data)
    else:
        with lenient_fetches(cap):
            records = fetcher.MemoryRecords(data)
    tp = TopicPartition("catalog-events", 0)
    unpacked = PartitionRecords(tp, records, None, 0, None, None, True, READ_UNCOMMITTED)
    return [unpacked_record.value for unpacked_record in unpacked]


@pytest.mark.parametrize("codec", CODECS)
def test_a_batch_within_the_cap_reads_as_aiokafka_reads_it(codec: str) -> None:
    values = [b'{"type": "BookPriceChanged", "book_id": %d}' % i * 40 for i in range(200)]
    data = _compressed(CODECS[codec], values)
    assert len(data) < sum(map(len, values)) // 4  # compressed indeed
    assert _read(data, cap=2 << 20) == _read(data, cap=None) == values


@pytest.mark.parametrize("codec", CODECS)
def test_a_batch_inflating_past_the_cap_is_a_corrupt_record(codec: str) -> None:
    """Two records of 600 KB of zeros: 1.2 MB, over a cap of 1 MiB (read whole at 2 MiB)."""
    data = _compressed(CODECS[codec], [bytes(600_000), bytes(600_000)])
    assert len(data) < 100_000
    assert _read(data, cap=2 << 20) == [bytes(600_000), bytes(600_000)]
    with pytest.raises(CorruptRecordException, match="1048576"):
        _read(data, cap=1 << 20)


def test_a_snappy_block_of_negative_length_is_a_corrupt_record() -> None:
    """The walk over xerial blocks that checks their declared sizes refuses it too."""
    body = b"\x82SNAPPY\x00" + struct.pack("!iii", 1, 1, -4) + b"\x00" * 8
    data = batch([], codec=CODECS["snappy"], body=body, count=1)
    with pytest.raises(CorruptRecordException, match="snappy block of -4 bytes"):
        _read(data, cap=1 << 20)


def test_the_records_of_an_inflated_batch_are_read_leniently_too() -> None:
    """A compressed batch with a header name that is not UTF-8: the Python re-read reads
    the batch decompressed within the cap, not decompressing it again itself."""
    plain = batch([record(0, b"k", b"v0", [(b"\xff", b"v")]), record(1, None, b"v1", [])])
    body = bytes(cramjam.zstd.compress(plain[61:]))  # the records section, compressed
    zstd = batch([], codec=CODECS["zstd"], body=body, count=2)
    assert _read(zstd, cap=1 << 20) == [b"v0", b"v1"]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_zstd_batch_that_inflates_to_gigabytes_is_set_aside_not_fatal(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """One record, codec zstd, its body a valid zstd frame of RLE blocks (4 bytes per 128
    KiB of zeros): 256 KiB that inflate to 8 GiB. aiokafka's decompression of it died in
    3 GiB of address space (SIGABRT), and every restart on the same batch."""
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    path = write_config(tmp_path / "layered_cache.toml", config, '[namespaces.book]\nkey = "book:{id}"')
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    tp = TopicPartition(unique_topic, 0)
    keys = [f"{prefix}book:{i}" for i in (1, 2)]
    await seed(redis_client, keys)
    bomb = batch([], codec=CODECS["zstd"], body=zstd_rle_bomb(8 << 30), count=1)
    assert len(bomb) < 300_000
    log = tmp_path / "daemon.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, waited on below
            [sys.executable, "-m", "consumers", "--config", str(path)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=_limited,
        )
    try:
        assert await eventually(lambda: bool(logged(log, "partitions_assigned")), timeout=30)
        async with producer(kafka_bootstrap) as p:
            await p.send_and_wait(unique_topic, price_changed(1), partition=0)

            async def first_applied() -> bool:
                return (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] >= 1

            # The daemon works under the limit: book:1 applied and committed.
            assert await eventually(first_applied, timeout=20), log.read_text()[-800:]
            await send_raw(p, unique_topic, 0, bomb)
            await p.send_and_wait(unique_topic, price_changed(2), partition=0)

        async def moved_on() -> bool:
            if proc.poll() is not None:
                return True
            return (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] >= 3

        await eventually(moved_on, timeout=30, interval=0.2)
        assert proc.poll() is None, f"daemon died ({proc.poll()}): " + log.read_text()[-600:]
        assert (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] >= 3
        assert await existing(redis_client, keys) == []
        (aside,) = logged(log, "unreadable_record_set_aside")
        assert aside["offset"] == 1 and "not decompressed within" in aside["error"], aside
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
