"""The daemon stops cleanly whatever state its dependencies are in: SIGTERM during a
Kafka incident, a standby that lost its partitions in the middle of a Redis outage.

Against real brokers and Redis servers the tests start and kill themselves.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.servers import KafkaBroker, create_topic
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
