"""What /readyz says while the daemon's world changes under it: partitions taken away
in the middle of a Redis outage, a broker or a Redis that dies.

"/readyz: 200 when connected and not retrying; 503 otherwise" (docs/daemon.md) is what
the Deployment's readinessProbe (and a rollout with maxUnavailable: 0) relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import pytest

from layered_cache.daemon import Daemon
from tests.helpers import eventually
from tests.servers import RedisServer, create_topic
from tests.test_daemon import daemon_config, http_get, price_changed, producer, running

pytestmark = pytest.mark.kafka


async def readyz(daemon: Daemon) -> tuple[int, dict[str, Any]]:
    assert daemon.health is not None and daemon.health.bound_port
    status, body = await http_get(daemon.health.bound_port, "/readyz")
    return status, msgspec.json.decode(body)


def prefer(tag: bytes) -> type:
    """A partition assignor that hands every partition to the member tagged b"B" when
    there is one, so the test decides which daemon ends up a standby."""
    from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
    from aiokafka.coordinator.protocol import (
        ConsumerProtocolMemberAssignment,
        ConsumerProtocolMemberMetadata,
    )

    class PreferB(RoundRobinPartitionAssignor):  # type: ignore[misc]
        name = "test_prefer_b"

        @classmethod
        def metadata(cls, topics: Any) -> Any:
            return ConsumerProtocolMemberMetadata(cls.version, list(topics), tag)

        @classmethod
        def assign(cls, cluster: Any, members: Any) -> Any:
            tagged = [m for m, meta in members.items() if meta.user_data == b"B"]
            if not tagged:
                return super().assign(cluster, members)
            topics = {t for meta in members.values() for t in meta.subscription}
            owned = sorted((t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics)
            return {
                m: ConsumerProtocolMemberAssignment(
                    cls.version, owned if m == tagged[0] else [], b""
                )
                for m in members
            }

    return PreferB


async def test_a_daemon_that_lost_its_partitions_mid_retry_is_ready_again_as_a_standby(
    prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """Daemon A retries a batch while Redis is down; B joins and takes A's partition, so
    A abandons the batch (uncommitted, B redoes it). Redis comes back and B works off the
    backlog. A, an idle standby now, used to answer 503 {"retrying": "invalidate"}
    forever: the abandoned retry loop never cleared its flag."""
    with RedisServer() as server:
        group = f"g-ready-{prefix.rstrip(':')}"
        await create_topic(kafka_bootstrap, unique_topic, 1)

        def make(tag: bytes) -> Daemon:
            config = daemon_config(server.url, prefix, kafka_bootstrap, unique_topic, group=group)
            options = {"partition_assignment_strategy": (prefer(tag),)}
            return Daemon(config, health_port=0, consumer_options=options)

        a, b = make(b"A"), make(b"B")
        async with running(a), producer(kafka_bootstrap) as p:
            server.kill()
            await p.send_and_wait(unique_topic, price_changed(1))
            assert await eventually(lambda: a.stats.redis_retries >= 2, timeout=10)
            assert (await readyz(a))[0] == 503  # retrying: rightly not ready
            task_b = asyncio.create_task(b.run())
            try:
                assert await eventually(
                    lambda: bool(b.assignment) and not a.assignment, timeout=20
                ), "B never took the partition over"
                server.start()
                assert await eventually(lambda: b.stats.commits >= 1, timeout=15)
                assert (await readyz(b))[0] == 200
                status_a, body_a = await readyz(a)
                assert status_a == 200, f"standby A answers {status_a} {body_a}"
                assert body_a["retrying"] is None and body_a["partitions"] == []
            finally:
                b.stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task_b, 20)
