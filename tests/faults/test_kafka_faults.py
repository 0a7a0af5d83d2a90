"""The daemon under Kafka-side faults: broker restarts, repeated SIGKILLs."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka.structs import TopicPartition

from consumers import Daemon
from tests.helpers import eventually
from tests.servers import KafkaBroker, create_topic
from tests.test_daemon import (
    committed,
    committed_total,
    daemon_config,
    daemon_process,
    existing,
    logged,
    price_changed,
    producer,
    running,
    seed,
    write_config,
)

pytestmark = pytest.mark.kafka


async def test_broker_restart_under_the_daemon_loses_no_event_and_commits_nothing_early(
    redis_url: str, prefix: str, durable_kafka_broker: KafkaBroker, unique_topic: str
) -> None:
    bootstrap = durable_kafka_broker.bootstrap
    await create_topic(bootstrap, unique_topic, 2)
    config = daemon_config(redis_url, prefix, bootstrap, unique_topic)
    group = config.kafka.group_id
    tps = [TopicPartition(unique_topic, p) for p in range(2)]
    client = aioredis.Redis.from_url(redis_url)
    key = f"{prefix}book:{{}}".format
    await seed(client, [key(i) for i in range(400)])
    where: dict[tuple[int, int], str] = {}
    violations: list[str] = []

    async def produce(ids: range) -> None:
        async with producer(bootstrap) as p:
            futures = [await p.send(unique_topic, price_changed(i), partition=i % 2) for i in ids]
            for i, meta in zip(ids, await asyncio.gather(*futures), strict=True):
                where[(meta.partition, meta.offset)] = key(i)

    async def watch_commits() -> None:
        """Committed offsets may never cover an event whose key still exists."""
        while True:
            with contextlib.suppress(Exception):
                offsets = await committed(bootstrap, group, tps)
                below = [k for (part, off), k in where.items() if off < offsets[part]]
                if left := await existing(client, below):
                    violations.append(f"committed {offsets} but {left[:3]} remain")
            await asyncio.sleep(0.1)

    daemon = Daemon(config)
    async with running(daemon):
        watcher = asyncio.create_task(watch_commits())
        await produce(range(200))
        assert await eventually(lambda: committed_total(bootstrap, group, tps, 200), timeout=20)
        durable_kafka_broker.kill()
        await asyncio.sleep(1.0)  # the daemon's fetches and commits fail meanwhile
        durable_kafka_broker.start()
        await produce(range(200, 400))
        assert await eventually(lambda: committed_total(bootstrap, group, tps, 400), timeout=60)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert violations == [], violations[:3]
    assert await existing(client, [key(i) for i in range(400)]) == []
    await client.aclose()


async def test_daemon_sigkilled_repeatedly_during_20000_events_deletes_every_key(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str, tmp_path: Path
) -> None:
    total = 20_000
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, max_batch=500)
    path = write_config(
        tmp_path / "layered_cache.toml", config, '[namespaces.book]\nkey = "book:{id}"'
    )
    await create_topic(kafka_bootstrap, unique_topic, 4)
    tps = [TopicPartition(unique_topic, p) for p in range(4)]
    client = aioredis.Redis.from_url(redis_url)
    keys = [f"{prefix}book:{i}" for i in range(total)]
    await seed(client, keys)

    async def remaining() -> int:
        return int(await client.exists(*keys))

    # The last 2,000 events wait for the third kill: a daemon that restarts quickly (or a
    # slow producer on a loaded machine) can't finish everything before it is killed 3 times.
    killed_thrice = asyncio.Event()
    async with producer(kafka_bootstrap) as p:

        async def produce() -> None:
            for start in range(0, total, 1000):
                if start >= total - 2000:
                    await killed_thrice.wait()
                for i in range(start, start + 1000):
                    await p.send(unique_topic, price_changed(i), partition=i % 4)
                await asyncio.sleep(0.1)
            await p.flush()

        flow = asyncio.create_task(produce())
        kills = 0
        for round_ in range(4):
            log = tmp_path / f"daemon-{round_}.log"
            with daemon_process(path, log) as proc:
                assert await eventually(
                    lambda log=log: bool(logged(log, "partitions_assigned")), timeout=30
                )
                before = await remaining()
                # Let it delete some, then crash it without any shutdown work.
                await eventually(lambda before=before: _fewer(remaining, before, 1500), timeout=15)
                if await remaining() == 0:
                    break
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                if kills >= 3:
                    killed_thrice.set()
        killed_thrice.set()
        await flow
        log = tmp_path / "daemon-final.log"
        with daemon_process(path, log) as proc:
            # Started for real (signal handlers installed) before it is asked to stop.
            assert await eventually(lambda: bool(logged(log, "partitions_assigned")), timeout=30)
            assert await eventually(lambda: _fewer(remaining, 1, 1), timeout=60)
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, config.kafka.group_id, tps, total),
                timeout=30,
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
    assert kills >= 3
    assert await remaining() == 0
    await client.aclose()
    print(f"\n20,000 events, daemon SIGKILLed {kills} times: every key deleted")


async def _fewer(remaining: object, than: int, by: int) -> bool:
    return bool(than - await remaining() >= by)  # type: ignore[operator]
