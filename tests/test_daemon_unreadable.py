"""A record aiokafka reports as larger than the fetch size: the careful pass sets aside
that record, not the one after it.

With a stand-in consumer, because no broker these tests run can produce the error:
aiokafka raises ``RecordTooLargeError`` for a partition whose fetched data is a record
batch cut short (``max_partition_fetch_bytes``), and brokers cut one only for the old
fetch versions (0-2, brokers before Kafka 0.10.1): newer ones answer the first batch
whole (KIP-74) or, for a later partition of the response, nothing. The test broker
(tansu 0.6.0) answered a 200 KB record whole with ``max_partition_fetch_bytes`` and
``fetch_max_bytes`` set to 1, under every ``api_version`` down to 0.9. The stand-in does
what aiokafka's fetcher does then: it moves the position one past the record
(``consumed_to(position + 1)``) and raises the error naming the record's offset.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import RecordTooLargeError
from aiokafka.structs import TopicPartition

from layered_cache.daemon.dlq import Poison
from layered_cache.daemon.unreadable import read_carefully

FETCH_BYTES = 1_048_576


class _CutBatchConsumer:
    """One partition of records 0..end-1; record ``too_large`` comes in a cut batch."""

    def __init__(self, tp: TopicPartition, too_large: int, end: int) -> None:
        self.tp, self.too_large, self.end = tp, too_large, end
        self.at = 0

    def assignment(self) -> set[TopicPartition]:
        return {self.tp}

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int, max_records: int
    ) -> dict[TopicPartition, list[Any]]:
        if self.at >= self.end:
            return {}
        if self.at == self.too_large:
            fetched_at, self.at = self.at, self.at + 1  # aiokafka: consumed_to(position + 1)
            raise RecordTooLargeError(
                "There are some messages at [Partition=Offset]: %s=%s whose size is larger "
                "than the fetch size %s and hence cannot be ever returned.",
                self.tp,
                fetched_at,
                FETCH_BYTES,
            )
        record, self.at = SimpleNamespace(offset=self.at), self.at + 1
        return {self.tp: [record]}

    async def position(self, tp: TopicPartition) -> int:
        return self.at

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.at = offset


async def test_a_record_larger_than_the_fetch_size_is_set_aside_and_the_next_one_is_read() -> None:
    """The pass took the partition's position for the unreadable record's offset. Here
    that is one past it: record 2, a valid event, was dead-lettered under a reason that
    was not its own and skipped, never applied, and record 1 was skipped unrecorded.
    (Before that, the error was not one the daemon knew as a record's: run() raised it,
    and every restart met it again.)"""
    tp = TopicPartition("catalog-events", 0)
    consumer = _CutBatchConsumer(tp, too_large=1, end=4)
    handled: list[int] = []
    set_aside: list[Poison] = []

    async def handle(records: Mapping[TopicPartition, Sequence[Any]]) -> bool:
        handled.extend(record.offset for batch in records.values() for record in batch)
        return True

    async def aside(poison: Poison, moved: TopicPartition) -> bool:  # as Daemon._set_aside
        set_aside.append(poison)
        consumer.seek(moved, poison.offset + 1)
        return True

    await read_carefully(consumer, handle, aside, 10, asyncio.Event())  # type: ignore[arg-type]

    assert handled == [0]
    assert [(p.offset, p.key, p.value) for p in set_aside] == [(1, None, None)]
    assert set_aside[0].reason.startswith("unreadable record (RecordTooLargeError")
    assert await consumer.position(tp) == 2  # the daemon's next poll reads record 2
