"""The dead-letter topic: poison events with the reason and where they came from.

Headers (all UTF-8 text), after the original message's own headers:

    dlq.reason               why the event was rejected
    dlq.original.topic       topic it was read from
    dlq.original.partition   its partition
    dlq.original.offset      its offset
    dlq.original.timestamp   its timestamp (ms)
    dlq.event.type           its ``type`` if it had one
    dlq.original.size        only when the value was truncated (see below)

The value is the original bytes, except for events over ``kafka.max_event_bytes``:
those are cut to the first 64 KiB (enough to see what they were) because the full
payload may not fit the broker's message size limit a second time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["PREVIEW_BYTES", "Poison", "dead_letter_record", "send_dead_letters"]

PREVIEW_BYTES = 64 * 1024


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


def dead_letter_record(
    poison: Poison, max_event_bytes: int
) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """(key, value, headers) of the DLQ message for ``poison``."""
    headers = list(poison.headers)
    headers += [
        ("dlq.reason", poison.reason.encode()),
        ("dlq.original.topic", poison.topic.encode()),
        ("dlq.original.partition", str(poison.partition).encode()),
        ("dlq.original.offset", str(poison.offset).encode()),
        ("dlq.original.timestamp", str(poison.timestamp).encode()),
    ]
    if poison.event_type is not None:
        headers.append(("dlq.event.type", poison.event_type.encode()))
    value = poison.value
    if value is not None and len(value) > max_event_bytes:
        headers.append(("dlq.original.size", str(len(value)).encode()))
        value = value[:PREVIEW_BYTES]
    return poison.key, value, headers


async def send_dead_letters(
    producer: Any, topic: str, poisons: Sequence[Poison], max_event_bytes: int
) -> None:
    """Send all, then wait for all acks: one round of batching instead of N round trips.
    Raises on any failure; the caller retries the whole set (duplicates are acceptable,
    losing a poison event is not)."""
    futures = []
    for poison in poisons:
        key, value, headers = dead_letter_record(poison, max_event_bytes)
        futures.append(await producer.send(topic, value=value, key=key, headers=headers))
    await asyncio.gather(*futures)
