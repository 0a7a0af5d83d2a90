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
from typing import Any

import pytest
import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from layered_cache._keys import backplane_stream_name
from layered_cache.daemon import Daemon
from layered_cache.daemon.closing import close_in_order
from layered_cache.daemon.stopping import STOP_GRACE
from tests.helpers import eventually
from tests.servers import FAST_GROUP_KWARGS, KafkaBroker, RedisServer, create_topic
from tests.test_daemon import (
    daemon_config,
    daemon_process,
    logged,
    price_changed,
    producer,
    write_config,
)

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


GRACE = 25.0  # under the 30 s terminationGracePeriodSeconds / TimeoutStopSec


async def _stop_within_the_grace(daemon: Daemon, task: asyncio.Task[None]) -> float:
    """stop() as a SIGTERM does; how long the daemon took to end (it must, in GRACE)."""
    stopped_at = time.monotonic()
    daemon.stop()
    done, _ = await asyncio.wait({task}, timeout=GRACE)
    took = time.monotonic() - stopped_at
    assert done, f"stop() not done {took:.0f}s after SIGTERM (SIGKILL would come first)"
    task.result()
    return took


async def _batch_past_its_deletes_with_the_broker_dead(
    daemon: Daemon, server: RedisServer, broker: KafkaBroker, topic: str, events: list[bytes]
) -> None:
    """``events`` read as one batch whose deletes wait on a Redis outage; the broker dies,
    Redis comes back: the deletes and the backplane XADD go through, and the batch goes
    on to its dead letters and commit with no broker to answer."""
    assert await eventually(lambda: bool(daemon.assignment), timeout=20)
    server.stop()
    async with producer(broker.bootstrap) as p:
        for value in events:
            await p.send(topic, value, partition=0)
        await p.flush()
    assert await eventually(lambda: daemon.stats.redis_retries >= 1, timeout=15)
    broker.kill()
    server.start()
    client = aioredis.Redis.from_url(server.url)
    stream = backplane_stream_name(daemon.config.redis.prefix, daemon.config.backplane.stream)
    try:
        assert await eventually(lambda: client.xlen(stream), timeout=15), "deletes never done"
    finally:
        await client.aclose()
    await asyncio.sleep(1.0)  # past its deletes, waiting on the dead broker


async def test_sigterm_while_a_batch_commit_waits_on_a_dead_broker_exits_within_the_grace(
    kafka_broker: KafkaBroker, prefix: str, unique_topic: str
) -> None:
    """aiokafka retries a commit to a broker that does not answer with no deadline, and
    the commit was awaited with no regard for stop(): the daemon never ended while the
    broker was down. Giving the commit up loses nothing (the batch is read again)."""
    with RedisServer() as server:
        await create_topic(kafka_broker.bootstrap, unique_topic, 1)
        daemon = Daemon(daemon_config(server.url, prefix, kafka_broker.bootstrap, unique_topic))
        task = asyncio.create_task(daemon.run())
        try:
            await _batch_past_its_deletes_with_the_broker_dead(
                daemon, server, kafka_broker, unique_topic, [price_changed(1)]
            )
            await _stop_within_the_grace(daemon, task)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_sigterm_while_dead_letters_wait_for_the_metadata_of_a_dead_broker_exits_within_the_grace(
    kafka_broker: KafkaBroker, prefix: str, unique_topic: str
) -> None:
    """A send to a topic the producer has no metadata for waits for it (40 s), and the
    poison records of a batch were sent one after the other: 3 poison records held one
    attempt 2 minutes, and stop() was only looked at between attempts. (A broker up
    whose dead-letter topic is missing, auto-creation off, does the same.)"""
    with RedisServer() as server:
        await create_topic(kafka_broker.bootstrap, unique_topic, 1)
        daemon = Daemon(daemon_config(server.url, prefix, kafka_broker.bootstrap, unique_topic))
        task = asyncio.create_task(daemon.run())
        try:
            await _batch_past_its_deletes_with_the_broker_dead(
                daemon,
                server,
                kafka_broker,
                unique_topic,
                [b"not json 1", b"not json 2", b"not json 3", price_changed(1)],
            )
            await _stop_within_the_grace(daemon, task)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert daemon.stats.commits == 0  # nothing committed past the poison


async def test_sigterm_while_connecting_to_a_broker_that_never_answers_exits_within_the_grace(
    redis_url: str, prefix: str, unique_topic: str
) -> None:
    """A hung broker, a stalled load balancer: connections accepted, nothing answered.
    aiokafka's bootstrap waits 40 s for the answer (longer for a consumer start that got
    further), and stop() was only looked at between connect attempts: SIGKILL, no
    daemon_stopped, the health server and the Redis client never closed."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing, keep the connection open

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    daemon = Daemon(daemon_config(redis_url, prefix, f"127.0.0.1:{port}", unique_topic))
    task = asyncio.create_task(daemon.run())
    try:
        assert await eventually(lambda: bool(held), timeout=10), "never connected"
        await asyncio.sleep(1.0)  # its bootstrap request is waiting for an answer
        await _stop_within_the_grace(daemon, task)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for writer in held:
            writer.close()
        server.close()


class _DeadBrokerConsumer:
    """A consumer whose commits never get an answer (aiokafka retries them for ever)."""

    def __init__(self, position: int) -> None:
        self._position = position
        self.commits = 0

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits += 1
        await asyncio.Event().wait()

    async def position(self, tp: TopicPartition) -> int:
        return self._position

    def highwater(self, tp: TopicPartition) -> int:
        return self._position


async def test_after_a_sigterm_a_batch_spends_at_most_the_grace_on_commits(prefix: str) -> None:
    """The batch's commit given up after the grace, the catch-up commit that follows
    every batch re-sent it with a grace of its own: 6 s of the shutdown, not 3."""
    config = daemon_config("redis://127.0.0.1:1/0", prefix, "127.0.0.1:1", "catalog-events")
    daemon = Daemon(config, health_port=-1)
    tp = TopicPartition("catalog-events", 0)
    consumer = _DeadBrokerConsumer(position=5)
    daemon._kafka.consumer = consumer  # type: ignore[assignment]
    daemon._commits.committed[tp] = 3  # an earlier batch's commit went through
    daemon.stop()  # SIGTERM while the batch [3, 5) is being finished
    started = time.monotonic()
    await daemon._commit({tp: 5})  # the batch's own commit, as _handle does
    await daemon._catch_up(consumer)  # what run() does next after _handle returned True
    took = time.monotonic() - started
    assert took < STOP_GRACE + 1.0, (
        f"{took:.1f}s on commits after the SIGTERM ({consumer.commits} commits tried)"
    )


class _UnansweredCommitted:
    """A consumer whose ``committed()`` never gets an answer (aiokafka asks again for
    ever while the broker doesn't answer)."""

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("catalog-events", 0)}

    async def committed(self, tp: TopicPartition) -> int:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def position(self, tp: TopicPartition) -> int:
        return 0


async def test_stop_ends_a_rewind_or_an_assignment_waiting_on_an_unanswered_committed() -> None:
    """The rewind after an unreadable fetch and the check of uncommitted partitions at
    an assignment asked ``committed()`` with nothing watching stop(): on a dead broker a
    SIGTERM went unseen there until the SIGKILL."""
    from layered_cache.daemon.kafka import uncommitted_starts
    from layered_cache.daemon.unreadable import rewind

    consumer, stopping = _UnansweredCommitted(), asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, stopping.set)
    await asyncio.wait_for(rewind(consumer, "earliest", stopping), 2)  # type: ignore[arg-type]
    assigned = consumer.assignment()
    starts = await asyncio.wait_for(uncommitted_starts(consumer, assigned, stopping), 2)  # type: ignore[arg-type]
    assert starts == {}  # nothing to commit once stopping


@pytest.mark.parametrize("swallowed", ["returns", "raises another error"])
async def test_the_watch_ends_when_its_probe_drops_the_cancel_of_close(swallowed: str) -> None:
    """A daemon stopped as it started (a `none` group without a position, a SIGTERM at
    once) hung in its shutdown 1 run in 5: close() cancelled the watch while a probe ran,
    and the probe's wait_for (Python 3.11's, aiokafka's) returned the result that came
    with the cancel and dropped it, or a client turned it into its own error; the watch
    ran on and close() waited for it for good."""
    from layered_cache.daemon.watch import Watch

    entered = asyncio.Event()

    async def probe() -> None:
        if entered.is_set():
            return  # only the first cancel is dropped: the loop's teardown ends the rest
        entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed == "returns":
                return
            raise ConnectionError("request cut short") from None

    watch = Watch({"broker": probe}, interval=0.01)
    watch.start()
    await asyncio.wait_for(entered.wait(), 2)
    await asyncio.wait_for(watch.close(), 2)


async def _port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


@pytest.mark.timeout(240)
async def test_a_daemon_task_cancelled_while_the_broker_is_down_still_closes_its_health_server(
    redis_url: str, prefix: str, unique_topic: str
) -> None:
    """An app embedding the daemon (``await daemon.run()``) cancels its task after the
    broker died. aiokafka's consumer.stop() re-raises the CancelledError of the fetch
    task it cancels, and with run() cancelled ``cancelling()`` was 1 all through the
    shutdown: that error was taken for a new cancel and let out, so the purges, the
    health server and Redis were never closed, ``daemon_stopped`` never logged. aiokafka
    raises only when a fetch task is pending then (about 4 rounds in 5): 4 rounds."""
    left_open = []
    with KafkaBroker() as broker:
        for round_ in range(4):
            if round_:
                broker.start()  # same port, empty (memory storage)
            topic = f"{unique_topic}-{round_}"
            await create_topic(broker.bootstrap, topic, 1)
            config = daemon_config(redis_url, prefix, broker.bootstrap, topic)
            options = {"retry_backoff_ms": 3000}
            daemon = Daemon(config, health_port=0, consumer_options=options)
            task = asyncio.create_task(daemon.run())
            assert await eventually(lambda: bool(daemon.assignment) or task.done(), timeout=20)
            assert daemon.health is not None and daemon.health.bound_port
            port = daemon.health.bound_port
            broker.kill()
            await asyncio.sleep(1.0)  # the consumer's fetch fails and backs off
            with structlog.testing.capture_logs() as logs:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, 40)
            assert task.cancelled()  # the app's cancel still ends run() as cancelled
            if await _port_open(port) or "daemon_stopped" not in _events(logs):
                left_open.append(round_)
                await daemon.health.close()  # the test's own clean-up
    assert not left_open, f"rounds {left_open}: run() ended, its health server open"


def _events(logs: list[dict[str, Any]]) -> list[str]:
    return [entry["event"] for entry in logs]


async def test_a_cancel_during_one_shutdown_step_closes_the_next_ones_then_ends_the_task() -> None:
    """Each step is bounded: a cancel that lands in one waits for the rest, then is
    raised. A client's own CancelledError (no cancel of this task) is only logged."""
    closed: list[str] = []
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(30)

    async def clients_own() -> None:
        raise asyncio.CancelledError  # as aiokafka's stop() re-raises its fetch task's

    async def health() -> None:
        closed.append("health")

    await close_in_order([("kafka", clients_own), ("health", health)])
    assert closed == ["health"]
    task = asyncio.create_task(close_in_order([("kafka", slow), ("health", health)]))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == ["health", "health"]


def _pending_others(before: set[asyncio.Task[object]]) -> list[str]:
    me = asyncio.current_task()
    return sorted(
        repr(task.get_coro())
        for task in asyncio.all_tasks()
        if task is not me and task not in before and not task.done()
    )


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_second_cancel_while_the_consumer_closes_still_closes_both_kafka_clients(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """Found by a review of this session's fix (2026-12-06). First cancel: run() ends, its
    ``finally`` closes the parts. Second cancel, while the
    consumer's stop() is under way (LeaveGroup to the broker): ``kafka._stop`` sees
    ``cancelling()`` grow and re-raises: ``asyncio.wait_for`` has cancelled the consumer's
    stop() half-way (its fetcher, heartbeat and commit-refresh tasks go on running: the
    group member keeps heartbeating, its partitions never move to the other daemons), and
    ``KafkaClients.disconnect`` never reaches the dead-letter producer's stop() (its
    sender task and connections left open, "Unclosed AIOKafkaProducer"). close_in_order
    logs ``shutdown_step_interrupted`` and goes on to the next *step*, but the step the
    cancel landed in is left half done."""
    await create_topic(kafka_bootstrap, unique_topic, 1)
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    daemon = Daemon(config, health_port=-1)
    before = set(asyncio.all_tasks())
    task = asyncio.create_task(daemon.run())
    assert await eventually(lambda: bool(daemon.assignment) or task.done(), timeout=30)
    assert not task.done()
    kafka = daemon._kafka  # only to time the second cancel: the consumer is closing
    task.cancel()
    for _ in range(100_000):
        await asyncio.sleep(0)
        if task.done() or (kafka.consumer is None and kafka.producer is not None):
            break
    assert not task.done(), "the shutdown ended before the consumer's stop() was under way"
    task.cancel()  # the second cancel, while the consumer's stop() runs
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 60)
    assert task.cancelled()
    await asyncio.sleep(1.0)  # anything closing in the background has ended by now
    left = _pending_others(before)
    assert not left, f"run() ended, tasks of the daemon still running: {left}"
