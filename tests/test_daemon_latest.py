"""A new consumer group under ``auto_offset_reset = "latest"`` keeps at-least-once from
its first assignment on.

Before its first commit such a group has no position but "the end, whenever asked".
A daemon that fetched events and stopped (crashed, Redis unreachable, a deploy) before
committing left the group without one, and the next daemon started at the new end:
the events in between were never applied. Each partition's starting position is now
committed as it is assigned, so whatever arrives after that is owed to the group."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from layered_cache.daemon import Daemon
from tests.helpers import eventually
from tests.servers import RedisServer, create_topic
from tests.test_daemon import daemon_config, existing, price_changed, producer, running, seed

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
