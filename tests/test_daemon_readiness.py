"""What /readyz says while the daemon's world changes under it: partitions taken away
in the middle of a Redis outage, a broker or a Redis that dies.

"/readyz: 200 when connected and not retrying; 503 otherwise" (docs/daemon.md) is what
the Deployment's readinessProbe (and a rollout with maxUnavailable: 0) relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import msgspec
import pytest
from aiokafka import errors as Errors
from aiokafka.structs import TopicPartition

from layered_cache.daemon import Daemon
from layered_cache.daemon.deletes import Deleter
from layered_cache.daemon.watch import INTERVAL
from tests.helpers import eventually, make_config
from tests.servers import KafkaBroker, RedisClusterServers, RedisServer, create_topic
from tests.test_daemon import (
    ROUTES,
    daemon_config,
    http_get,
    price_changed,
    producer,
    running,
    seed,
)

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

                async def a_ready() -> bool:  # its watch pings Redis every 2 s
                    return (await readyz(a))[0] == 200

                assert await eventually(a_ready, timeout=10, interval=0.2)
                status_a, body_a = await readyz(a)
                assert status_a == 200, f"standby A answers {status_a} {body_a}"
                assert body_a["retrying"] is None and body_a["partitions"] == []
            finally:
                b.stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task_b, 20)


async def not_ready(daemon: Daemon) -> bool:
    return (await readyz(daemon))[0] == 503


async def test_readyz_turns_503_within_seconds_of_the_kafka_broker_dying(
    prefix: str, redis_url: str, unique_topic: str
) -> None:
    """With its only broker gone, aiokafka's getmany() just returns nothing: the daemon
    answered 200 "ok" forever while events piled up unseen. Now the watch's end-offset
    request fails and readiness says so, as at start-up; it recovers with the broker."""
    with KafkaBroker() as broker:
        config = daemon_config(redis_url, prefix, broker.bootstrap, unique_topic)
        await create_topic(broker.bootstrap, unique_topic, 1)
        daemon = Daemon(config, health_port=0)
        async with running(daemon):
            async with producer(broker.bootstrap) as p:
                await p.send_and_wait(unique_topic, price_changed(1))
            assert await eventually(lambda: daemon.stats.commits >= 1, timeout=10)
            assert (await readyz(daemon))[0] == 200
            broker.kill()
            assert await eventually(lambda: not_ready(daemon), timeout=15, interval=0.5)
            assert (await readyz(daemon))[1]["retrying"] == "kafka"
            daemon.stop()


async def test_readyz_turns_503_within_seconds_of_redis_dying_even_when_idle(
    prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """An idle daemon had no delete to fail: with its Redis gone it answered 200 while it
    could invalidate nothing. The watch PINGs Redis; ready again once Redis is back."""
    with RedisServer() as server:
        config = daemon_config(server.url, prefix, kafka_bootstrap, unique_topic)
        await create_topic(kafka_bootstrap, unique_topic, 1)
        daemon = Daemon(config, health_port=0)
        async with running(daemon):
            assert (await readyz(daemon))[0] == 200
            server.kill()
            assert await eventually(lambda: not_ready(daemon), timeout=10, interval=0.5)
            assert (await readyz(daemon))[1]["retrying"] == "redis"
            server.start()
            assert await eventually(lambda: ready(daemon), timeout=15, interval=0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dead", [1, 2])  # not servers[0], the client's default node
async def test_an_idle_daemon_is_not_ready_within_seconds_of_a_cluster_master_dying(
    prefix: str, kafka_bootstrap: str, unique_topic: str, dead: int
) -> None:
    """On a cluster, redis-py sends PING to its default node only: with another master
    dead (a third of the slots, every delete there failing) the idle daemon said 200
    "ok" for good. Every master is asked now; ready again once the master is back."""
    with RedisClusterServers(3) as cluster:
        await create_topic(kafka_bootstrap, unique_topic, 1)
        kafka = msgspec.structs.asdict(
            daemon_config(cluster.url, prefix, kafka_bootstrap, unique_topic).kafka
        )
        redis = {"cluster": True, "timeout": "1s"}
        book = {"book": {"key": "book:{id}"}}
        config = make_config(cluster.url, prefix, book, redis=redis, kafka=kafka, events=ROUTES)
        daemon = Daemon(config, health_port=0)
        async with running(daemon):
            assert await eventually(lambda: ready(daemon), timeout=15)
            cluster.servers[dead].kill()  # a master: a third of the slots
            assert await eventually(lambda: not_ready(daemon), timeout=20, interval=0.5)
            assert (await readyz(daemon))[1]["retrying"] == "redis"
            cluster.servers[dead].start()
            cluster.wait_ok()
            assert await eventually(lambda: ready(daemon), timeout=20, interval=0.5)


async def ready(daemon: Daemon) -> bool:
    return (await readyz(daemon))[0] == 200


def lag_total(metrics: bytes) -> float:
    return sum(
        float(m.group(1))
        for m in re.finditer(rb"^layered_cache_daemon_lag\{[^}]*\} (\S+)$", metrics, re.M)
    )


async def test_the_lag_gauge_grows_while_a_redis_outage_piles_up_events(
    prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """docs/operations.md: "While Redis is down ... the lag grows; alert on
    layered_cache_daemon_lag". The gauge was written only after a batch committed, so
    during the outage it stayed at its pre-outage 0 while 150 events sat uncommitted."""
    with RedisServer() as server:
        config = daemon_config(server.url, prefix, kafka_bootstrap, unique_topic)
        await create_topic(kafka_bootstrap, unique_topic, 1)
        daemon = Daemon(config, health_port=0)
        async with running(daemon), producer(kafka_bootstrap) as p:
            await p.send_and_wait(unique_topic, price_changed(0))
            assert await eventually(lambda: daemon.stats.commits >= 1, timeout=10)
            server.kill()
            # One record per produce request: the test broker (tansu) answers ListOffsets
            # with the last record *batch*'s base offset + 1, so a batched backlog would
            # show less lag than there is; Apache Kafka answers the high watermark.
            for i in range(1, 51):
                await p.send_and_wait(unique_topic, price_changed(i))
            assert await eventually(lambda: daemon.stats.redis_retries >= 2, timeout=10)
            for i in range(51, 151):
                await p.send_and_wait(unique_topic, price_changed(i))
            assert daemon.health is not None and daemon.health.bound_port
            port = daemon.health.bound_port

            async def lag_of_the_backlog() -> bool:
                return lag_total((await http_get(port, "/metrics"))[1]) >= 150

            assert await eventually(lag_of_the_backlog, timeout=10, interval=0.5), daemon.lag
            server.start()
            assert await eventually(lambda: daemon.stats.events >= 151, timeout=30)


async def test_a_partition_moved_while_the_watch_asks_the_broker_leaves_the_lag_gauge(
    prefix: str, redis_url: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """A's watch asks the broker for the committed offset of a partition A has not
    committed yet (1); meanwhile B joins and takes every partition. The lag of partition
    0, worked out before that answer, came back with it: A's gauge and /metrics showed
    a partition B owns, for good (only a revocation removes one, and A had none left)."""
    group = f"g-lag-{prefix.rstrip(':')}"
    await create_topic(kafka_bootstrap, unique_topic, 2)

    def make(tag: bytes) -> Daemon:
        config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, group=group)
        options = {"partition_assignment_strategy": (prefer(tag),)}
        return Daemon(config, health_port=0, consumer_options=options)

    a, b = make(b"A"), make(b"B")
    task_b: asyncio.Task[None] | None = None
    async with running(a), producer(kafka_bootstrap) as p:
        await p.send_and_wait(unique_topic, price_changed(1), partition=0)
        assert await eventually(lambda: (unique_topic, 0) in a.lag, timeout=10)
        consumer = a._kafka.consumer
        assert consumer is not None
        ask = consumer.committed

        async def answered_after_b_joined(tp: TopicPartition) -> int | None:
            nonlocal task_b
            if tp.partition == 1 and task_b is None:
                task_b = asyncio.create_task(b.run())
                assert await eventually(lambda: not a.assignment, timeout=2.5, interval=0.01)
            return await ask(tp)

        consumer.committed = answered_after_b_joined  # type: ignore[method-assign]
        try:
            assert await eventually(lambda: len(b.assignment) == 2, timeout=20)
            await asyncio.sleep(2 * INTERVAL + 0.5)  # the watch's next rounds
            assert not a.assignment and a.lag == {}, f"A's gauge shows {a.lag}"
            assert a.health is not None and a.health.bound_port
            metrics = (await http_get(a.health.bound_port, "/metrics"))[1]
            assert b"layered_cache_daemon_lag{" not in metrics  # no partition at all
        finally:
            b.stop()
            if task_b is not None:
                await asyncio.wait_for(task_b, 20)


def lag_series(metrics: bytes) -> list[str]:
    return re.findall(rb"^layered_cache_daemon_lag\{([^}]*)\} \S+$", metrics, re.M)


async def test_a_batch_that_outlived_its_partition_leaves_no_lag_for_a_partition_it_lost(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """docs/daemon.md, `layered_cache_daemon_lag{topic,partition}`: "only partitions the
    daemon owns". Daemon A's batch is slow in Redis (a gate) past half of
    rebalance_timeout; B joins and takes the partition (A's rebalance hook gives up and
    clears A's lag); then A's delete lands and the abandoned batch goes on, its commit
    refused. A, owning nothing, exported lag for B's partition on every scrape: the
    batch's end re-added what the rebalance hook had removed."""
    group = f"g-late-{prefix.rstrip(':')}"
    await create_topic(kafka_bootstrap, unique_topic, 1)
    tp = TopicPartition(unique_topic, 0)

    def make(tag: bytes) -> Daemon:
        config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, group=group)
        options = {"partition_assignment_strategy": (prefer(tag),)}
        return Daemon(config, health_port=0, consumer_options=options)

    a, b = make(b"A"), make(b"B")
    gate = asyncio.Event()
    entered = asyncio.Event()
    original = Deleter.delete

    async def slow_for_a(self: Deleter, *args: Any, **kwargs: Any) -> None:
        if self is a._deleter and not gate.is_set():
            entered.set()
            await gate.wait()  # a slow Redis round trip, which then succeeds
        await original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Deleter, "delete", slow_for_a)
        async with running(a), producer(kafka_bootstrap) as p:
            assert a.assignment == {tp}
            await p.send_and_wait(unique_topic, price_changed(1), partition=0)
            await asyncio.wait_for(entered.wait(), 10)
            task_b = asyncio.create_task(b.run())
            try:
                assert await eventually(
                    lambda: b.assignment == {tp} and not a.assignment, timeout=20
                ), "B never took the partition over"
                assert a.lag == {}  # _drain cleared it
                gate.set()  # A's delete lands now: its abandoned batch carries on
                assert await eventually(lambda: a.stats.commit_failures >= 1, timeout=10)
                await asyncio.sleep(INTERVAL + 0.5)  # a watch round on A
                text = a.metrics.render()
                assert b"layered_cache_daemon_assigned_partitions 0.0" in text
                series = lag_series(text)
                assert series == [], f"A (owning nothing) exports lag for {series}"
            finally:
                b.stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task_b, 20)


async def _transaction(bootstrap: str, topic: str) -> None:
    """One event in a transaction: the record at offset 0, its commit marker at 1, so
    the daemon's catch-up commits 2 after the batch (``commits``)."""
    from confluent_kafka import Producer as RdKafkaProducer

    rd = RdKafkaProducer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}"})
    await asyncio.to_thread(rd.init_transactions, 10)
    rd.begin_transaction()
    rd.produce(topic, value=price_changed(1), partition=0)
    await asyncio.to_thread(rd.commit_transaction, 10)


def _a_and_b(redis_url: str, prefix: str, bootstrap: str, topic: str) -> tuple[Daemon, Daemon]:
    """Two daemons of one group; B, once it joins, gets every partition (``prefer``)."""
    group = f"g-cu-{prefix.rstrip(':')}"

    def make(tag: bytes) -> Daemon:
        config = daemon_config(redis_url, prefix, bootstrap, topic, group=group)
        return Daemon(config, consumer_options={"partition_assignment_strategy": (prefer(tag),)})

    return make(b"A"), make(b"B")


async def _stop_all(*runs: tuple[Daemon, asyncio.Task[None] | None]) -> None:
    for daemon, task in runs:
        daemon.stop()
        if task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 20)


@pytest.mark.timeout(120)
async def test_a_catch_up_commit_answered_after_its_partition_moved_does_not_crash_the_daemon(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str, redis_client: Any
) -> None:
    """docs/daemon.md: "A commit refused because the partition moved is logged and
    counted, never an error". A's catch-up commit past a transaction marker is answered
    COORDINATOR_LOAD_IN_PROGRESS (retriable) while B joins and takes the partition;
    aiokafka retries it with the generation current then, the broker accepts it, and A
    asked ``highwater`` of a partition no longer assigned: an AssertionError ended
    ``Daemon.run``."""
    await create_topic(kafka_bootstrap, unique_topic, 1)
    tp = TopicPartition(unique_topic, 0)
    a, b = _a_and_b(redis_url, prefix, kafka_bootstrap, unique_topic)
    task_a = asyncio.create_task(a.run())
    task_b: asyncio.Task[None] | None = None
    try:
        assert await eventually(lambda: bool(a.assignment) or task_a.done(), timeout=20)
        consumer = a._kafka.consumer
        assert consumer is not None
        original = consumer._coordinator._do_commit_offsets
        held = asyncio.Event()

        async def commit_offsets(assignment: Any, offsets: Any) -> Any:  # the broker's answer
            nonlocal task_b
            if not held.is_set() and offsets.get(tp) is not None and offsets[tp].offset == 2:
                held.set()  # the catch-up commit past the marker: B joins meanwhile
                task_b = asyncio.create_task(b.run())
                await eventually(lambda: tp not in consumer.assignment(), timeout=30)
                raise Errors.GroupLoadInProgressError()  # retriable: aiokafka retries
            return await original(assignment, offsets)

        consumer._coordinator._do_commit_offsets = commit_offsets
        await seed(redis_client, [f"{prefix}book:1"])
        await _transaction(kafka_bootstrap, unique_topic)
        assert await eventually(held.is_set, timeout=20), a.stats
        assert await eventually(lambda: bool(b.assignment), timeout=30)
        await asyncio.sleep(3)  # A's retry lands, then its next polls
        crashed = task_a.exception() if task_a.done() else None
        assert not task_a.done(), f"daemon A died: {crashed!r}"
    finally:
        await _stop_all((a, task_a), (b, task_b))


@pytest.mark.timeout(120)
async def test_a_catch_up_commit_answered_as_its_partition_is_revoked_leaves_no_lag_series(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str, redis_client: Any
) -> None:
    """The lag gauge covers "only partitions the daemon owns" (docs/daemon.md). A's
    catch-up commit goes through, but A reads the answer after its revocation hook
    cleared the partition's lag: the catch-up wrote it back, and A, owning nothing,
    exported B's partition's lag for good (the watch updates owned partitions only)."""
    await create_topic(kafka_bootstrap, unique_topic, 1)
    tp = TopicPartition(unique_topic, 0)
    a, b = _a_and_b(redis_url, prefix, kafka_bootstrap, unique_topic)
    task_a = asyncio.create_task(a.run())
    task_b: asyncio.Task[None] | None = None
    try:
        assert await eventually(lambda: bool(a.assignment) or task_a.done(), timeout=20)
        consumer = a._kafka.consumer
        assert consumer is not None
        original = consumer.commit
        held = asyncio.Event()

        async def commit(offsets: Any = None) -> None:  # committed; answer read after _drain
            nonlocal task_b
            await original(offsets)
            if not held.is_set() and offsets and offsets.get(tp) == 2:
                held.set()  # the catch-up commit past the marker
                task_b = asyncio.create_task(b.run())
                await eventually(lambda: not a.assignment, timeout=30)  # _drain ran

        consumer.commit = commit  # type: ignore[method-assign]
        await seed(redis_client, [f"{prefix}book:1"])
        await _transaction(kafka_bootstrap, unique_topic)
        assert await eventually(held.is_set, timeout=20), a.stats
        assert await eventually(lambda: b.assignment == {tp} and not a.assignment, timeout=30)
        await asyncio.sleep(INTERVAL + 0.5)  # a watch round on A
        assert not task_a.done(), task_a.exception()
        text = a.metrics.render()
        assert b"layered_cache_daemon_assigned_partitions 0.0" in text
        series = lag_series(text)
        assert series == [], f"A (owning nothing) exports lag for {series}"
        assert tp not in a._commits.committed  # nor a stale offset for when it comes back
    finally:
        await _stop_all((a, task_a), (b, task_b))
