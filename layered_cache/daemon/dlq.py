"""The dead-letter topic: poison events with the reason and where they came from.

Headers (all UTF-8 text), after the original message's own headers:

    dlq.reason               why the event was rejected (at most REASON_BYTES)
    dlq.original.topic       topic it was read from
    dlq.original.partition   its partition
    dlq.original.offset      its offset
    dlq.original.timestamp   its timestamp (ms)
    dlq.event.type           its ``type`` if it had one (at most REASON_BYTES)
    dlq.original.size        only when the value was truncated: its size in bytes
    dlq.original.key.size    only when the key was truncated: its size in bytes
    dlq.original.headers.dropped   only when original headers were left out: how many

Every record fits the producer's 1 MiB request limit by construction: the reason is
capped, the original headers and key get a budget of their own, and a value over
``kafka.max_event_bytes`` (or over what is left of RECORD_BYTES) is cut to its first
64 KiB, with its original size in a header.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import structlog
from aiokafka.errors import (
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnknownError,
)

from layered_cache._config import KafkaConfig
from layered_cache.daemon.stats import DaemonStats

__all__ = [
    "PREVIEW_BYTES",
    "REASON_BYTES",
    "RECORD_BYTES",
    "REJECTED",
    "UNKNOWN_ATTEMPTS",
    "DeadLetters",
    "Poison",
    "cap_text",
    "dead_letter",
    "dead_letter_record",
    "send_dead_letters",
]

_log = structlog.get_logger("layered_cache.daemon")

PREVIEW_BYTES = 64 * 1024
REASON_BYTES = 300
# Key + value + headers of one DLQ record: under aiokafka's default max_request_size
# (1,048,576) and Kafka's default message.max.bytes (1,048,588), with room for framing.
RECORD_BYTES = 1_000_000
HEADERS_BYTES = 64 * 1024  # the original message's headers kept on the DLQ copy
KEY_BYTES = 16 * 1024
_HEADER_OVERHEAD = 8  # per header on the wire (varint lengths), a generous estimate

#: Producer failures that no retry can fix: the record itself is refused (too large,
#: invalid), or the client rejects its arguments. The record is set aside, counted and
#: logged; the partition moves on. Everything else (broker down, timeouts, leader
#: changes, authorisation) may pass and is retried without committing.
REJECTED: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    AssertionError,
    ValueError,
    TypeError,
)


#: A broker's answer aiokafka has no class for comes as ``UnknownError``, its code
#: dropped: INVALID_RECORD (87: a null key on a compacted topic, a value the broker's
#: schema validation refuses) never passes; UNKNOWN_SERVER_ERROR (-1) may. A record
#: answered so on this many attempts in a row, for ``UNKNOWN_FOR`` seconds at least, is
#: refused for good, as ``REJECTED`` is: retried for ever, it stalled its partition. The
#: span, not just the count: three quick answers (~0.15 s of backoff) of a broker's
#: passing hiccup set aside a dead letter, and its original was committed with no copy.
UNKNOWN_ATTEMPTS = 3
UNKNOWN_FOR = 30.0
#: How long an attempt waits for the dead-letter topic's metadata (once, before sending).
METADATA_WAIT = 10.0


class Poison(msgspec.Struct, frozen=True):
    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    reason: str
    event_type: str | None


def cap_text(text: str, limit: int = REASON_BYTES) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes, the cut marked with the original size."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    marker = f"... [{len(data)} bytes]"
    return data[: max(0, limit - len(marker))].decode("utf-8", "ignore") + marker


def _header_size(name: str, value: bytes | None) -> int:
    return len(name.encode("utf-8", "replace")) + len(value or b"") + _HEADER_OVERHEAD


def _writable(name: str) -> str:
    """A header name aiokafka's producer can write (UTF-8 only): one read leniently
    (``header_names``, its bytes not UTF-8) gets those bytes as ``\\xNN`` escapes."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return name


def dead_letter_record(
    poison: Poison, max_event_bytes: int
) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) of the DLQ message for ``poison``; always fits RECORD_BYTES."""
    meta = [
        ("dlq.reason", cap_text(poison.reason).encode()),
        ("dlq.original.topic", poison.topic.encode()),
        ("dlq.original.partition", str(poison.partition).encode()),
        ("dlq.original.offset", str(poison.offset).encode()),
        ("dlq.original.timestamp", str(poison.timestamp).encode()),
    ]
    if poison.event_type is not None:
        meta.append(("dlq.event.type", cap_text(poison.event_type).encode()))
    headers: list[tuple[str, bytes]] = []
    used = 0
    dropped = 0
    for original, header_value in poison.headers:
        name = _writable(original)
        size = _header_size(name, header_value)
        if used + size > HEADERS_BYTES:
            dropped += 1
            continue
        headers.append((name, header_value))
        used += size
    if dropped:
        meta.append(("dlq.original.headers.dropped", str(dropped).encode()))
    key = poison.key
    if key is not None and len(key) > KEY_BYTES:
        meta.append(("dlq.original.key.size", str(len(key)).encode()))
        key = key[:KEY_BYTES]
    value = poison.value if poison.value is not None else b""
    fixed = used + sum(_header_size(n, v) for n, v in meta) + len(key or b"")
    room = RECORD_BYTES - fixed - 64  # 64: the dlq.original.size header added below
    if len(value) > max_event_bytes or len(value) > room:
        meta.append(("dlq.original.size", str(len(value)).encode()))
        value = value[: min(PREVIEW_BYTES, room)]
    return key, value, headers + meta


class DeadLetters:
    """A batch's poison records not written yet, kept across the attempts of
    ``Retrier.until_done``: a retry resends only these, and the ``UnknownError``
    answers of each are counted (``UNKNOWN_ATTEMPTS``)."""

    def __init__(self, poison: Iterable[Poison]) -> None:
        self.pending: list[Poison] = list(poison)
        # Per record: the UnknownError answers in a row, and when the first came.
        self._unknown: dict[tuple[str, int, int], tuple[int, float]] = {}

    @property
    def one_by_one(self) -> bool:
        """After an ``UnknownError``: a broker refuses a whole request for one record in
        it (INVALID_RECORD), so the records go one per request, each answered for itself
        (sent together, the others' copies were refused with it, and set aside too)."""
        return bool(self._unknown)

    def refused(self, poison: Poison, error: BaseException) -> bool:
        """Whether ``error``, the answer to ``poison``'s copy, refuses it for good."""
        if isinstance(error, REJECTED):
            return True
        where = (poison.topic, poison.partition, poison.offset)
        if not isinstance(error, UnknownError):
            self._unknown.pop(where, None)  # in a row: another answer starts it again
            return False
        now = time.monotonic()
        count, first = self._unknown.get(where, (0, now))
        self._unknown[where] = (count + 1, first)
        return count + 1 >= UNKNOWN_ATTEMPTS and now - first >= UNKNOWN_FOR


async def _queue(
    producer: Any, topic: str, poison: Poison, max_event_bytes: int
) -> asyncio.Future[Any]:
    """``poison``'s copy handed to the producer: the future of its ack, or of the error
    that refused it before it was queued (size, arguments)."""
    try:
        key, value, headers = dead_letter_record(poison, max_event_bytes)
        sent: asyncio.Future[Any] = await producer.send(
            topic, value=value, key=key, headers=headers
        )
    except Exception as exc:
        sent = asyncio.get_running_loop().create_future()
        sent.set_exception(exc)
    return sent


async def _answers(
    producer: Any, topic: str, letters: DeadLetters, max_event_bytes: int
) -> list[Any]:
    """What the broker answered for each pending record (an ack or an error)."""
    if letters.one_by_one:  # each acked before the next is queued: a request of its own
        answers: list[Any] = []
        for poison in letters.pending:
            sent = await _queue(producer, topic, poison, max_event_bytes)
            answers += await asyncio.gather(sent, return_exceptions=True)
        return answers
    futures = [await _queue(producer, topic, p, max_event_bytes) for p in letters.pending]
    return await asyncio.gather(*futures, return_exceptions=True)


async def _wait_for_metadata(producer: Any, topic: str) -> None:
    """Once per attempt, bounded: each send to a topic whose metadata the producer lacks
    waits for it itself (``request_timeout_ms``, 40 s), and the records are queued one
    after the other: with the broker gone, N records held one attempt N x 40 s."""
    try:
        async with asyncio.timeout(METADATA_WAIT):
            await producer.partitions_for(topic)
    except TimeoutError:
        raise KafkaTimeoutError(f"no metadata for {topic!r} within {METADATA_WAIT:g} s") from None


async def send_dead_letters(
    producer: Any,
    topic: str,
    letters: DeadLetters,
    max_event_bytes: int,
    on_rejected: Callable[[Poison, BaseException], None],
) -> None:
    """Send every pending record of ``letters`` and wait for the acks.

    Records that were written, or refused for good (``DeadLetters.refused``:
    ``on_rejected`` is told), leave ``letters.pending``. If any failed transiently, it
    keeps exactly those and the first such error is raised: the caller retries only them
    (a duplicate on the DLQ is acceptable, losing a poison event is not)."""
    await _wait_for_metadata(producer, topic)
    results = await _answers(producer, topic, letters, max_event_bytes)
    transient: list[Poison] = []
    first: BaseException | None = None
    for poison, result in zip(list(letters.pending), results, strict=True):
        if not isinstance(result, BaseException):
            continue
        if letters.refused(poison, result):
            on_rejected(poison, result)
        else:
            transient.append(poison)
            first = first or result
    letters.pending[:] = transient
    if first is not None:
        raise first


async def dead_letter(
    producer: Any, kafka: KafkaConfig, letters: DeadLetters, stats: DaemonStats
) -> None:
    """Write ``letters`` to the DLQ, counting and logging each record settled; its
    ``pending`` is emptied as records are settled (see ``send_dead_letters``), so a retry
    resends only what failed transiently."""
    sent = list(letters.pending)
    rejected: set[int] = set()

    def set_aside(item: Poison, error: BaseException) -> None:
        rejected.add(id(item))
        stats.dead_letters_rejected += 1
        _log.error(
            "dead_letter_rejected_skipped",
            error=cap_text(f"{type(error).__name__}: {error}"),
            reason=item.reason,
            topic=item.topic,
            partition=item.partition,
            offset=item.offset,
            size=len(item.value or b""),
        )

    try:
        await send_dead_letters(
            producer, kafka.dead_letter_topic, letters, kafka.max_event_bytes, set_aside
        )
    finally:
        # Written = left ``pending`` without being set aside (also when a later one failed).
        still = {id(item) for item in letters.pending}
        for item in sent:
            if id(item) in still or id(item) in rejected:
                continue
            stats.dead_letters += 1
            _log.warning(
                "event_dead_lettered",
                reason=item.reason,
                event_type=item.event_type,
                topic=item.topic,
                partition=item.partition,
                offset=item.offset,
            )
