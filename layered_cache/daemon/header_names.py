"""Header names that are not UTF-8: the record is read anyway, not set aside unread.

Kafka's header names are bytes on the wire (a Go or C producer may write any); aiokafka
decodes them as strict UTF-8 inside ``getmany``. Such a record was unreadable
(``unreadable``): set aside with no key or value. Worse, aiokafka decodes a record batch
from its first record at every fetch (it skips the records below the position only
after decoding them), so once the bad record was set aside and the partition sought past
it, the next fetch raised the same error at the next position: every later record of the
same batch was set aside as unreadable too, its event never applied.

The daemon's consumer reads such a name with ``surrogateescape`` instead: the record is
handled like any other, applied, or dead-lettered as poison with its key and value
(``dlq`` writes the name as ``\\xNN`` escapes: aiokafka's producer writes UTF-8 names only).

aiokafka has no hook for its decoding: its fetcher builds ``MemoryRecords`` (C) from each
fetch response's bytes, by a module-level name. ``lenient_fetches`` puts ``_records`` there
and sets ``_LENIENT`` around the daemon's ``consumer.start()``: the consumer's fetch task
is created there and copies that context, so only its fetches are wrapped; any other
consumer in the process gets aiokafka's own records. In the daemon's, batches decode in C
as before; only a batch whose C decoding fails on a header name is decoded again, in
Python, from the record after the last one it handed out. And whatever else decoding a
batch raises there, whichever decoder of aiokafka's broke on it, is raised as the corrupt
record it is (``_decoding``): the daemon sets it aside (``unreadable``) and goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import aiokafka
import structlog
from aiokafka.consumer import fetcher
from aiokafka.errors import CorruptRecordException, KafkaError

try:  # aiokafka's pure-Python batch and record: private, so maybe gone in a later one
    from aiokafka.record.default_records import _DefaultRecordBatchPy, _DefaultRecordPy
except ImportError:  # then no lenient reading: such a record is set aside (``unreadable``)
    _DefaultRecordBatchPy = _DefaultRecordPy = None
_BatchPy: Any = _DefaultRecordBatchPy or object  # ``_LenientBatch``'s base (unused if None)

__all__ = ["lenient_fetches"]

_log = structlog.get_logger("layered_cache.daemon")

_T = TypeVar("_T")
_LENIENT: ContextVar[bool] = ContextVar("layered_cache_lenient_header_names", default=False)
_MEMORY_RECORDS: Any = getattr(fetcher, "MemoryRecords", None)  # aiokafka's own
# What the pure-Python re-read raising means aiokafka's batch changed inside, not a bad
# record (that is ``CorruptRecordException``): the original error is raised then.
_CHANGED = (AttributeError, TypeError, IndexError, KeyError, NameError, ValueError, OverflowError)
_LOG_OVERHEAD = 12  # every batch, v0 to v2: base offset (8 bytes), length (4), then length
_MAGIC_AT = 16  # after the offset, length and partition leader epoch (4): the format


@contextlib.contextmanager
def lenient_fetches() -> Iterator[None]:
    """Around a consumer's ``start()``: its fetches read header names leniently."""
    hookable = _MEMORY_RECORDS is not None and _DefaultRecordBatchPy is not None
    if not hookable:  # said at each start: the defence this module is is off
        _log.warning(
            "kafka_header_names_strict",
            aiokafka=getattr(aiokafka, "__version__", "?"),
            consequence="this aiokafka lacks the classes read leniently with: a record "
            "whose header name is not UTF-8 sets aside the valid records after it in its "
            "batch as unreadable (to the dead-letter topic, unapplied)",
        )
    if hookable and fetcher.MemoryRecords is _MEMORY_RECORDS:
        fetcher.MemoryRecords = _records  # aiokafka changed: left alone (``unreadable``)
    token = _LENIENT.set(True)
    try:
        yield
    finally:
        _LENIENT.reset(token)


def _records(data: bytes) -> Any:
    records = _MEMORY_RECORDS(data)
    return _Records(records, data) if _LENIENT.get() else records


class _Records:
    """aiokafka's ``MemoryRecords`` of ``data``, each batch handed out as a ``_Batch``."""

    def __init__(self, records: Any, data: bytes) -> None:
        self._records = records
        self._data = data
        self._start = 0  # where the next batch starts in ``data``

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        batch = _decoding(self._records.next_batch)
        if batch is None:
            return None
        start = self._start
        length = int.from_bytes(self._data[start + 8 : start + _LOG_OVERHEAD], "big")
        self._start = start + _LOG_OVERHEAD + length
        if self._data[start + _MAGIC_AT] != 2:
            # A legacy message set (magic 0/1): no headers to misread, and its batch is
            # no iterator of itself (``_Batch`` drives v2 batches only).
            return batch
        return _Batch(batch, self._data, start, self._start)


class _Batch:
    """One batch as aiokafka hands it out, until its C decoding fails on a header name:
    then the records after the last one handed out are decoded again (``_LenientBatch``).
    Anything else its decoding raises (a bad codec, record) is a ``CorruptRecordException``
    (``_decoding``)."""

    def __init__(self, batch: Any, data: bytes, start: int, end: int) -> None:
        self._batch = batch
        self._data = data
        self._span = (start, end)
        self._last = -1  # offset of the last record handed out
        self._rest: Iterator[Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)  # base_offset, validate_crc, is_control_batch...

    def __iter__(self) -> _Batch:
        # aiokafka's batch is its own iterator: this readies it (decompresses its records)
        _decoding(lambda: iter(self._batch))
        return self

    def __next__(self) -> Any:
        # ``_decoding``'s rule, inline: this runs once per record (a call and a closure
        # each cost ~0.5 us more per event than aiokafka alone).
        try:
            if self._rest is None:
                try:
                    record = next(self._batch)
                except UnicodeDecodeError as error:
                    self._rest = self._reread(error)
                else:
                    self._last = record.offset
                    return record
            return next(self._rest)
        except _PASSED:
            raise
        except Exception as exc:
            raise _corrupt(exc) from exc

    def _reread(self, error: UnicodeDecodeError) -> Iterator[Any]:
        """The records after the last one handed out, names read leniently. Should the
        re-read itself fail other than on a bad record (aiokafka's batch changed inside),
        the original error is raised: the record is set aside (``unreadable``), as
        without this module, rather than the daemon stopping on an unknown error."""
        start, end = self._span
        try:
            for record in _LenientBatch(memoryview(self._data)[start:end]):
                if record.offset > self._last:
                    yield record
        except _CHANGED as exc:
            raise error from exc


def _decoding(step: Callable[[], _T]) -> _T:
    """``step`` (decoding part of a fetched batch, all in memory), any exception it raises
    but a Kafka error, ``MemoryError`` or a header name's ``UnicodeDecodeError`` turned
    into ``CorruptRecordException``, which the daemon sets aside as an unreadable record
    (``unreadable``). A batch the broker stored as it came may break aiokafka's decoders
    in ways nobody listed (a snappy block cut short raised ``struct.error`` from
    ``snappy_decode``), and such an error left ``Daemon.run``: the daemon crashed, and
    crashed again on the same record at every restart. No I/O happens here, so nothing
    raised is a broker's or a connection's; ``CancelledError`` is no ``Exception``."""
    try:
        return step()
    except _PASSED:
        raise
    except Exception as exc:
        raise _corrupt(exc) from exc


# What decoding may raise that is no bad record: the end, Kafka's own, memory, a name.
_PASSED = (StopIteration, KafkaError, MemoryError, UnicodeDecodeError)


def _corrupt(exc: Exception) -> CorruptRecordException:
    kind, module = type(exc).__qualname__, type(exc).__module__
    name = kind if module == "builtins" else f"{module}.{kind}"  # struct.error
    return CorruptRecordException(f"{name} while decoding: {exc}")


class _LenientBatch(_BatchPy):  # type: ignore[misc]
    """aiokafka's pure-Python batch (its header, decompression, iteration), its records
    read as aiokafka reads them but for the header names, and within their bounds:
    every length is checked against where the record ends (``_varint``, ``_read_bytes``)
    before anything is read past it."""

    def _read_msg(self) -> _DefaultRecordPy:
        buffer: bytearray = self._buffer
        pos: int = self._pos  # type: ignore[has-type]  # aiokafka's, set in __init__
        length, pos = _varint(buffer, pos, len(buffer))
        start, end = pos, pos + length
        if length < 0 or end > len(buffer):
            raise CorruptRecordException(f"Invalid record of {length} bytes")
        _, pos = _varint(buffer, pos, end)  # attributes: none defined for records
        ts_delta, pos = _varint(buffer, pos, end)
        offset_delta, pos = _varint(buffer, pos, end)
        key, pos = _read_bytes(buffer, pos, end)
        value, pos = _read_bytes(buffer, pos, end)
        count, pos = _varint(buffer, pos, end)
        headers: list[tuple[str, bytes | None]] = []
        for _ in range(count):  # each header takes 2 bytes at least: ``end`` stops it
            size, pos = _varint(buffer, pos, end)
            if size < 0 or pos + size > end:
                raise CorruptRecordException(f"Invalid header key size {size}")
            name = bytes(buffer[pos : pos + size]).decode("utf-8", "surrogateescape")
            header_value, pos = _read_bytes(buffer, pos + size, end)
            headers.append((name, header_value))
        if count < 0 or pos != end:
            raise CorruptRecordException(f"Invalid record of {length} bytes at {start}")
        self._pos = pos
        appended = self.timestamp_type == self.LOG_APPEND_TIME
        timestamp = self.max_timestamp if appended else self.first_timestamp + ts_delta
        return _DefaultRecordPy(
            self.base_offset + offset_delta, timestamp, self.timestamp_type, key, value, headers
        )


def _varint(buffer: bytearray, pos: int, end: int) -> tuple[int, int]:
    """A zigzag varint (at most 10 bytes) from ``pos``, none of it at or past ``end``.
    Not aiokafka's ``decode_varint``: its Cython one reads without a bounds check, and a
    header value's length of 2**40 put the position there, the next read a segmentation
    fault of the daemon, again at every restart."""
    result = shift = 0
    while pos < end and shift < 64:
        byte = buffer[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
    raise CorruptRecordException(f"Invalid varint before byte {pos}")


def _read_bytes(buffer: bytearray, pos: int, end: int) -> tuple[bytes | None, int]:
    """A varint length, then that many bytes, none past ``end`` (a negative length:
    null)."""
    size, pos = _varint(buffer, pos, end)
    if size < 0:
        return None, pos
    if pos + size > end:
        raise CorruptRecordException(f"Invalid length {size}: {end - pos} bytes left")
    return bytes(buffer[pos : pos + size]), pos + size
