"""Records aiokafka itself cannot read, and how the daemon gets past them.

aiokafka unpacks records inside ``getmany``: a batch whose CRC or compression is broken
raises there, for the whole fetch, before the daemon sees a single record (a header
name that is not UTF-8 did too: the daemon's consumer reads those, ``header_names``).
Left alone the daemon crashed, and every restart crashed on the same record: nothing
ever moved the committed offset past it, and the partition stood still.

After such an error every assigned partition goes back to its last commit
(``rewind``): aiokafka drains a fetch partition by partition, moving each one's position
past the records it collected, and drops those records with the exception, so the
partitions drained before the bad one would otherwise skip records never applied. Then
they are read again one record at a time (``getmany(tp, max_records=1)``): the good
records before the bad one are handled as usual (each deleted and committed), and when a
partition raises, its position is the unreadable record's offset (one record at a time,
nothing was collected past it). That record goes to the dead-letter topic with no key
and no value (there are none to be had), only the reason and where it was; the partition
seeks past it and commits. A record the pass could not finish (the daemon stopping, the
partitions moving, its delete or dead-letter abandoned) ends the pass: nothing after it
is committed, so the next owner reads it again. ``stop()`` ends it before the next record.

Only record-level errors count. A ``KafkaError`` other than a corrupt record (a broker
refusing, authorisation) is about no one record, and is raised as before.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import struct
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import cramjam
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import (
    CorruptRecordException,
    IllegalStateError,
    InvalidMessageError,
    RecordTooLargeError,
    UnsupportedCodecError,
)
from aiokafka.structs import TopicPartition

from layered_cache.daemon.dlq import Poison, cap_text
from layered_cache.daemon.kafka import poll
from layered_cache.daemon.stopping import Stopped, unless_stopped

__all__ = ["UNREADABLE", "read_carefully", "rewind"]

_log = structlog.get_logger("layered_cache.daemon")

#: What aiokafka raises for one record or batch it cannot unpack: a header name that is
#: not UTF-8 (only if ``header_names`` could not hook aiokafka), a bad CRC or record, a
#: body that does not decompress with its declared codec (gzip: ``BadGzipFile``,
#: ``zlib.error``, ``EOFError`` when cut short; snappy in xerial framing cut short:
#: ``struct.error``; snappy, lz4, zstd: cramjam; a codec it has no decoder for:
#: ``UnsupportedCodecError``), a batch cut short at ``max_partition_fetch_bytes``
#: (``RecordTooLargeError``: only brokers before Kafka 0.10.1 cut one, newer ones answer
#: it whole, KIP-74; no fetch size gets it whole from them). Not ``OSError`` at large: a
#: network error is no record's. The daemon's consumer raises any other error of decoding
#: a batch as ``CorruptRecordException`` (``header_names._decoding``): this list is what
#: gets past without that hook.
UNREADABLE: tuple[type[BaseException], ...] = (
    RecordTooLargeError,
    UnicodeError,
    CorruptRecordException,
    InvalidMessageError,
    UnsupportedCodecError,
    gzip.BadGzipFile,
    zlib.error,
    EOFError,
    struct.error,
    cramjam.DecompressionError,
)

Records = Mapping[TopicPartition, Sequence[Any]]


async def rewind(
    consumer: AIOKafkaConsumer,
    reset: str,
    stopping: asyncio.Event,
    starts: Mapping[TopicPartition, int] | None = None,
) -> None:
    """Every assigned partition back to its last commit, everything before which was
    applied; one never committed, with ``auto_offset_reset = "earliest"``, to its start
    (a new member's start: deletes are idempotent). One never committed under "latest"
    goes back to where it started if its start commit has yet to go through (``starts``,
    ``Commits.unstarted``): kept where it was, the records drained before the bad one
    were skipped unapplied. Otherwise it keeps its position (where it started is not
    known). ``stop()`` ends it (``unless_stopped``: aiokafka asks a broker that doesn't
    answer for ever)."""
    for tp in consumer.assignment():
        try:
            offset = await unless_stopped(functools.partial(consumer.committed, tp), stopping)
            offset = (starts or {}).get(tp) if offset is None else offset
            if offset is not None:
                consumer.seek(tp, offset)
            elif reset == "earliest":
                await consumer.seek_to_beginning(tp)
        except Stopped:
            return  # the poll that follows ends at once too
        except IllegalStateError:
            # The partition moved in a rebalance meanwhile. aiokafka rebalances eagerly:
            # every partition was revoked, and each one assigned again starts from its
            # committed offset, so the partitions not yet rewound need nothing either.
            return


async def read_carefully(
    consumer: AIOKafkaConsumer,
    handle: Callable[[Records], Awaitable[bool]],
    set_aside: Callable[[Poison, TopicPartition], Awaitable[bool]],
    limit: int,
    stopping: asyncio.Event,
) -> None:
    """One careful pass: each assigned partition, one record at a time, until it has
    nothing fetched, ``limit`` records were handled, or an unreadable record was set
    aside (``set_aside`` dead-letters it, seeks past it and commits). ``handle`` or
    ``set_aside`` returning False (not done: stopping, revoked) ends the pass, and so
    does ``stopping`` before each record and during its poll (``poll``): every record
    here succeeding, it was never asked, and a SIGTERM read on through up to ``limit``
    records of every partition."""
    for tp in sorted(consumer.assignment()):
        for _ in range(limit):
            try:
                records = await poll(consumer, stopping, tp, max_records=1)
            except IllegalStateError:
                return  # the partition moved in a rebalance meanwhile
            except UNREADABLE as exc:
                try:
                    offset = _offset_of(exc, await consumer.position(tp))
                except IllegalStateError:
                    return  # moved meanwhile: its new owner finds the record again
                _log.warning(
                    "unreadable_record_set_aside",
                    topic=tp.topic,
                    partition=tp.partition,
                    offset=offset,
                    error=f"{type(exc).__name__}: {exc}",
                )
                if not await set_aside(_unreadable(tp, offset, exc), tp):
                    return
                break
            if records is None:
                return  # nothing read past what was handled: the next owner reads on
            if not records:
                break
            if not await handle(records):
                return


def _offset_of(exc: BaseException, position: int) -> int:
    """The unreadable record's offset, ``position`` being its partition's after ``exc``.
    Read one record at a time, nothing was taken past it: the position is the record's.
    Not for ``RecordTooLargeError``: aiokafka moves the position one past the record
    before raising it (``consumed_to(position + 1)``), and names the record's offset
    in it; taking the position, the pass set aside and skipped the record after it."""
    if not isinstance(exc, RecordTooLargeError):
        return position
    named = exc.args[2] if len(exc.args) > 2 else None  # (message, tp, offset, fetch size)
    return named if isinstance(named, int) else position - 1


def _unreadable(tp: TopicPartition, offset: int, exc: BaseException) -> Poison:
    return Poison(
        topic=tp.topic,
        partition=tp.partition,
        offset=offset,
        timestamp=-1,
        key=None,
        value=None,
        headers=(),
        reason=cap_text(f"unreadable record ({type(exc).__name__}: {exc})"),
        event_type=None,
    )
