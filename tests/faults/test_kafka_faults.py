"""The daemon under Kafka-side faults: broker restarts, repeated SIGKILLs."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
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


@pytest.mark.timeout(400)
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
    try:
        async with asyncio.timeout(300):
            await _restart_scenario(daemon, durable_kafka_broker, produce, watch_commits, tps)
    except BaseException:
        # Seen once on a loaded machine: a hang after the restart, with the daemon
        # refused by the broker's port. Keep the servers' own account for next time.
        print(durable_kafka_broker.log_tail(80))
        if durable_kafka_broker.s3 is not None:
            print(durable_kafka_broker.s3.log_tail(20))
        raise
    assert violations == [], violations[:3]
    assert await existing(client, [key(i) for i in range(400)]) == []
    await client.aclose()


async def _restart_scenario(
    daemon: Daemon,
    broker: KafkaBroker,
    produce: Callable[[range], Awaitable[None]],
    watch_commits: Callable[[], Awaitable[None]],
    tps: list[TopicPartition],
) -> None:
    bootstrap, group = broker.bootstrap, daemon.config.kafka.group_id
    async with running(daemon):
        watcher = asyncio.create_task(watch_commits())
        await produce(range(200))
        assert await eventually(lambda: committed_total(bootstrap, group, tps, 200), timeout=60)
        broker.kill()
        await asyncio.sleep(1.0)  # the daemon's fetches and commits fail meanwhile
        broker.start()
        await asyncio.wait_for(produce(range(200, 400)), 120)
        # The restarted broker reloads its state from S3; on a busy machine that and the
        # group's rejoin take a while: the outcome matters, not the speed.
        assert await eventually(lambda: committed_total(bootstrap, group, tps, 400), timeout=180)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


@pytest.mark.timeout(400)
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

    # The workload waits for the faults: chunk r+1 is produced only once the daemon of
    # round r has been killed, so keys stay outstanding until every kill has happened,
    # however fast this machine (or however slow) the daemon happens to be.
    kills_wanted = 3
    chunk = total // (kills_wanted + 1)
    async with producer(kafka_bootstrap) as p:

        async def produce(first: int) -> None:
            for i in range(first, first + chunk):
                await p.send(unique_topic, price_changed(i), partition=i % 4)
            await p.flush()

        kills = 0
        for round_ in range(kills_wanted):
            # Counted while no daemon runs: a fast daemon can delete most of a chunk
            # between its assignment and any later count, and 1,500 fewer than a count
            # taken then may never come (seen on CI).
            before = await remaining()
            flow = asyncio.create_task(produce(round_ * chunk))
            log = tmp_path / f"daemon-{round_}.log"
            with daemon_process(path, log) as proc:
                assert await eventually(
                    lambda log=log: bool(logged(log, "partitions_assigned")), timeout=60
                )
                # Let it delete some, then crash it without any shutdown work.
                assert await eventually(
                    lambda before=before: _fewer(remaining, before, 1500), timeout=60
                )
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
            await flow
        await produce(kills_wanted * chunk)
        log = tmp_path / "daemon-final.log"
        with daemon_process(path, log) as proc:
            # Started for real (signal handlers installed) before it is asked to stop.
            assert await eventually(lambda: bool(logged(log, "partitions_assigned")), timeout=60)
            assert await eventually(lambda: _fewer(remaining, 1, 1), timeout=120)
            assert await eventually(
                lambda: committed_total(kafka_bootstrap, config.kafka.group_id, tps, total),
                timeout=60,
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
    assert kills == kills_wanted
    assert await remaining() == 0
    await client.aclose()
    print(f"\n20,000 events, daemon SIGKILLed {kills} times: every key deleted")


async def _fewer(remaining: object, than: int, by: int) -> bool:
    return bool(than - await remaining() >= by)  # type: ignore[operator]
