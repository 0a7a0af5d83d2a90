"""The daemon stops cleanly whatever state its dependencies are in: SIGTERM during a
Kafka incident, a standby that lost its partitions in the middle of a Redis outage.

Against real brokers and Redis servers the tests start and kill themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from layered_cache.daemon import Daemon
from tests.helpers import eventually
from tests.servers import FAST_GROUP_KWARGS, KafkaBroker, create_topic
from tests.test_daemon import daemon_config, daemon_process, logged, write_config

pytestmark = pytest.mark.kafka


async def _wait_for_log(log: Path, event: str, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if logged(log, event):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_sigterm_while_the_kafka_broker_is_down_exits_0_and_logs_daemon_stopped(
    tmp_path: Path, redis_url: str, prefix: str, unique_topic: str
) -> None:
    """Operators restart daemons during a Kafka incident. With the broker gone, aiokafka's
    consumer.stop() re-raises the CancelledError of a fetch task sleeping in its retry
    backoff; that used to escape the shutdown as a traceback with exit 1, the producer,
    health server and Redis client never closed and daemon_stopped never logged."""
    with KafkaBroker() as broker:
        await create_topic(broker.bootstrap, unique_topic, 1)
        config = daemon_config(redis_url, prefix, broker.bootstrap, unique_topic)
        path = write_config(tmp_path / "daemon.toml", config, '[namespaces.book]\nkey = "book:{id}"')
        log = tmp_path / "daemon.log"
        with daemon_process(path, log) as proc:
            assert await _wait_for_log(log, "daemon_started", 20), log.read_text()[-2000:]
            broker.kill()
            await asyncio.sleep(2.0)  # the fetcher is now retrying against nobody
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
    text = log.read_text()
    assert code == 0, f"exit {code}; tail: {text[-800:]}"
    assert logged(log, "daemon_stopped"), text[-800:]
    assert "Traceback" not in text


async def test_sigterm_during_a_rebalance_the_broker_does_not_finish_exits_within_the_grace(
    kafka_broker: KafkaBroker, redis_url: str, prefix: str, unique_topic: str
) -> None:
    """A second member joins, the daemon gives its partitions up, and the broker dies
    before the group is formed again. aiokafka's getmany waits for the next assignment
    whatever its timeout, and with nobody to hand it out stop() was never seen: the
    daemon ran on until SIGKILL (30 s in the shipped files), its Redis client and health
    server never closed, no daemon_stopped. It now ends within the grace period."""
    await create_topic(kafka_broker.bootstrap, unique_topic, 2)
    config = daemon_config(redis_url, prefix, kafka_broker.bootstrap, unique_topic)
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.run())
    joining = AIOKafkaConsumer(
        unique_topic,
        bootstrap_servers=kafka_broker.bootstrap,
        group_id=config.kafka.group_id,
        enable_auto_commit=False,
        **FAST_GROUP_KWARGS,
    )
    join: asyncio.Task[None] | None = None
    try:
        assert await eventually(lambda: bool(daemon.assignment), timeout=20)
        join = asyncio.create_task(joining.start())
        assert await eventually(lambda: not daemon.assignment, timeout=20, interval=0.01)
        kafka_broker.kill()
        await asyncio.sleep(1.0)  # the poll loop is back in getmany, waiting to be assigned
        stopped_at = time.monotonic()
        daemon.stop()
        await asyncio.wait_for(asyncio.shield(task), 25)
        assert time.monotonic() - stopped_at < 25
    finally:
        if join is not None:
            join.cancel()
            await asyncio.gather(join, return_exceptions=True)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await joining.stop()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
