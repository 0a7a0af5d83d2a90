"""One ``getmany`` result, decoded: the keys to invalidate, the poison, the offsets.

Decoding is total: any failure makes the message poison with a reason naming it, so one
bad event can neither crash the daemon nor block its partition. Tombstones (null value)
are counted and skipped.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import structlog
from aiokafka.structs import TopicPartition

from layered_cache._events import EventDecoder, PoisonEvent
from layered_cache.daemon.dlq import Poison, cap_text
from layered_cache.daemon.stats import DaemonStats

__all__ = ["Batch", "account", "decode_batch"]

_log = structlog.get_logger("layered_cache.daemon")


class Batch(msgspec.Struct):
    keys: dict[str, int]  # key -> replica count, each key once, in the order first seen
    poison: list[Poison]
    tombstones: int
    types: dict[str, int]
    offsets: dict[TopicPartition, int]  # next offset to read = last + 1
    lag: dict[TopicPartition, int]
    tags: list[str] = msgspec.field(default_factory=list)  # tags to invalidate


def decode_batch(
    decoder: EventDecoder,
    records: Mapping[TopicPartition, Sequence[Any]],
    highwater: Callable[[TopicPartition], int | None],
) -> Batch:
    """Decode ``records``; ``highwater`` is the consumer's, for the lag gauge."""
    batch = Batch({}, [], 0, {}, {}, {})
    types: Tally[str] = Tally()
    collect, keys, tags = decoder.collect, batch.keys, batch.tags
    for tp, messages in records.items():
        for message in messages:
            value = message.value
            if value is None:
                # A tombstone (compacted topics write them to delete a key): it carries
                # no event, so there is nothing to invalidate or to set aside.
                batch.tombstones += 1
                continue
            try:
                event_type = collect(value, keys, tags)
            except PoisonEvent as exc:
                batch.poison.append(_poison(tp, message, exc.reason, exc.event_type))
            except Exception as exc:  # the decoder is total; this is the last net
                batch.poison.append(_poison(tp, message, f"{type(exc).__name__} while decoding"))
            else:
                types[event_type] += 1
        if messages:
            batch.offsets[tp] = messages[-1].offset + 1
            high = highwater(tp)
            if high is not None:
                batch.lag[tp] = max(0, high - batch.offsets[tp])
    batch.types = dict(types)
    return batch


def _poison(tp: TopicPartition, message: Any, reason: str, event_type: str | None = None) -> Poison:
    return Poison(
        topic=tp.topic,
        partition=tp.partition,
        offset=message.offset,
        timestamp=message.timestamp,
        key=message.key,
        value=message.value,
        headers=tuple(message.headers or ()),
        reason=cap_text(reason),
        event_type=None if event_type is None else cap_text(event_type),
    )


def account(stats: DaemonStats, batch: Batch, keys: int, elapsed: float) -> None:
    """Count a batch that was carried through (keys deleted, poison set aside, commit
    tried) and log it. A batch given up on is not counted: it will be read again."""
    stats.count_events(batch.types)
    stats.keys += keys
    stats.tombstones += batch.tombstones
    stats.batch_done(elapsed)
    _log.info(
        "batch_done",
        events=sum(batch.types.values()),
        event_types=batch.types,
        keys=keys,
        dead_letters=len(batch.poison),
        tombstones=batch.tombstones,
        lag=sum(batch.lag.values()),
        latency_ms=round(elapsed * 1000, 2),
    )
