"""A new consumer group under ``auto_offset_reset = "latest"`` keeps at-least-once from
its first assignment on.

Before its first commit such a group has no position but "the end, whenever asked".
A daemon that fetched events and stopped (crashed, Redis unreachable, a deploy) before
committing left the group without one, and the next daemon started at the new end:
the events in between were never applied. Each partition's starting position is now
committed as it is assigned, so whatever arrives after that is owed to the group; a
start commit that does not go through is owed too, tried again until it does."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import errors as Errors
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.structs import TopicPartition

from layered_cache.daemon import Daemon, core
from tests.helpers import eventually
from tests.servers import RedisServer, create_topic
from tests.test_daemon import (
    committed,
    daemon_config,
    existing,
    price_changed,
    producer,
    running,
    seed,
)
from tests.test_daemon_poison import _unreadable_batches

pytestmark = pytest.mark.kafka


async def test_events_a_new_latest_group_fetched_but_never_applied_reach_the_next_daemon(
    redis_client: aioredis.Redis, redis_url: str, prefix: str, kafka_bootstrap: str,
    unique_topic: str,
) -> None:
    await create_topic(kafka_bootstrap, unique_topic, 1)
    key = f"{prefix}book:1"
    await seed(redis_client, [key], replicas=8)
    group = f"g-latest-{unique_topic}"
    with RedisServer() as lost:  # the first daemon's Redis, gone once it has partitions
        first = Daemon(daemon_config(lost.url, prefix, kafka_bootstrap, unique_topic,
                                     group=group, auto_offset_reset="latest"))
        async with running(first):
            lost.stop()
            async with producer(kafka_bootstrap) as p:
                await p.send_and_wait(unique_topic, price_changed(1), partition=0)
            await asyncio.sleep(1.0)  # fetched; its deletes fail, nothing is committed
    assert await existing(redis_client, [key]) == [key]
    second = Daemon(daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic,
                                  group=group, auto_offset_reset="latest"))
    async with running(second):
        assert await eventually(
            lambda: _gone(redis_client, key), timeout=15
        ), "the event that arrived before any commit was skipped"


async def _gone(client: aioredis.Redis, key: str) -> bool:
    return await existing(client, [key]) == []


def _refuse_starts(monkeypatch: pytest.MonkeyPatch, refuse: Callable[[], bool]) -> list[object]:
    """Start commits (offset 0: the topics start empty) answered REBALANCE_IN_PROGRESS
    while ``refuse()`` (as when another replica's JoinGroup reaches the broker first);
    returns the refused ones."""
    original = GroupCoordinator._do_commit_offsets
    refused: list[object] = []

    async def refusing(self: GroupCoordinator, assignment: Any, offsets: Any) -> Any:
        if all(o.offset == 0 for o in offsets.values()) and refuse():
            refused.append(offsets)
            raise Errors.RebalanceInProgressError(self.group_id)
        return await original(self, assignment, offsets)

    monkeypatch.setattr(GroupCoordinator, "_do_commit_offsets", refusing)
    return refused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("refused", ["once", "until the first batch retries it"])
async def test_an_event_after_a_refused_start_commit_still_reaches_the_next_daemon(
    redis_client: aioredis.Redis, redis_url: str, prefix: str, kafka_bootstrap: str,
    unique_topic: str, monkeypatch: pytest.MonkeyPatch, refused: str,
) -> None:
    """The start commit was tried once; refused, it was counted and logged like any
    other commit failure and never tried again. The partition stayed uncommitted, and
    the event the first daemon fetched but could not apply (its Redis gone) was skipped
    by the next one, which started at the then end. Refused "until the first batch
    retries it", every catch-up's try is refused too: only the batch's own retry, before
    its deletes, gets the start committed."""
    await create_topic(kafka_bootstrap, unique_topic, 1)
    key = f"{prefix}book:1"
    await seed(redis_client, [key], replicas=8)
    group = f"g-latest-{unique_topic}"
    first: Daemon | None = None

    def refuse() -> bool:
        if first is None:
            return False  # the second daemon's commits
        if refused == "once":
            return not refusals
        return first._retrier.retrying != "start_commit"

    refusals = _refuse_starts(monkeypatch, refuse)
    with RedisServer() as lost:  # the first daemon's Redis, gone once it has partitions
        first = Daemon(daemon_config(lost.url, prefix, kafka_bootstrap, unique_topic,
                                     group=group, auto_offset_reset="latest"))
        async with running(first):
            assert await eventually(lambda: bool(refusals), timeout=10)  # its start commit
            lost.stop()
            async with producer(kafka_bootstrap) as p:
                await p.send_and_wait(unique_topic, price_changed(1), partition=0)
            await asyncio.sleep(1.0)  # fetched; its deletes fail, nothing else is committed
        stats, first = first.stats, None
    second = Daemon(daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic,
                                  group=group, auto_offset_reset="latest"))
    async with running(second):
        assert await eventually(lambda: _gone(redis_client, key), timeout=15), (stats, second.stats)


@pytest.mark.timeout(180)
async def test_an_unreadable_fetch_before_the_start_commit_went_through_loses_nothing(
    redis_url: str, prefix: str, kafka_bootstrap: str, redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a fetch aiokafka could not unpack, ``rewind`` takes each partition back to
    its commit, and one never committed under "latest" kept its position: with its
    start commit refused, the partitions drained before the bad one (aiokafka moves
    their positions as it collects their records, then drops them with the error) were
    read on from past records never applied. Which partitions come first depends on the
    fetch's order: a few fresh topics make it certain to be hit."""
    daemon: Daemon | None = None
    refusals = _refuse_starts(
        monkeypatch, lambda: daemon is not None and daemon._retrier.retrying != "start_commit"
    )
    gate = asyncio.Event()
    original_poll = core.poll

    async def gated(*args: Any, **kwargs: Any) -> Any:  # the daemon's loop, held
        await gate.wait()
        return await original_poll(*args, **kwargs)

    monkeypatch.setattr(core, "poll", gated)
    for _ in range(3):
        topic = f"unreadable-{uuid.uuid4().hex[:8]}"
        config = daemon_config(redis_url, prefix, kafka_bootstrap, topic, auto_offset_reset="latest")
        await create_topic(kafka_bootstrap, topic, 4)
        await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
        good = {part: [part * 100 + i for i in range(5)] for part in range(3)}
        keys = [f"{prefix}book:{b}" for books in good.values() for b in books]
        await seed(redis_client, keys, replicas=8)
        gate.clear()
        refusals.clear()
        daemon = Daemon(config)
        async with running(daemon):
            assert await eventually(lambda: bool(refusals), timeout=10)  # the starts, refused
            async with producer(kafka_bootstrap) as p:  # fetched while the loop is held
                for part, books in good.items():
                    for book in books:
                        await p.send_and_wait(topic, price_changed(book), partition=part)
                with pytest.MonkeyPatch.context() as bad:
                    _unreadable_batches(bad, "crc")
                    await p.send_and_wait(topic, price_changed(999), partition=3)
                await p.send_and_wait(topic, price_changed(998), partition=3)
            await asyncio.sleep(0.5)  # every partition's fetch buffered
            gate.set()
            tps = [TopicPartition(topic, part) for part in range(4)]

            async def settled() -> bool:
                offsets = await committed(kafka_bootstrap, config.kafka.group_id, tps)
                return offsets == {0: 5, 1: 5, 2: 5, 3: 2}

            assert await eventually(settled, timeout=30), daemon.stats
        daemon = None
        assert await existing(redis_client, keys) == []  # committed to the end: all applied
