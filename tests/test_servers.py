"""Smoke tests of the server fixtures themselves: if these fail, nothing else can pass."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis.asyncio as aredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from redis.asyncio.cluster import RedisCluster

from layered_cache import LayeredCache
from tests.helpers import make_config
from tests.servers import (
    FAST_GROUP_KWARGS,
    REDIS_PROTOCOL,
    REDIS_SERVER,
    ExistingRedisCluster,
    KafkaBroker,
    RedisClusterServers,
    RedisServer,
    ServerStartError,
    create_topic,
    free_port,
    kafka_reachable,
    redis_reachable,
)


async def test_redis_url_set_get(redis_url: str, prefix: str) -> None:
    client = aredis.Redis.from_url(redis_url)
    try:
        assert await client.ping()
        await client.set(f"{prefix}k", b"v", ex=60)
        assert await client.get(f"{prefix}k") == b"v"
    finally:
        await client.aclose()


async def test_the_fixtures_run_the_server_redis_server_selects(redis_server: RedisServer) -> None:
    """REDIS_SERVER=valkey (make test-valkey) really runs Valkey, not Redis by accident."""
    client = aredis.Redis.from_url(redis_server.url)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    assert ("valkey_version" in info) == (REDIS_SERVER == "valkey"), info


async def test_every_connection_of_the_cache_speaks_the_protocol_the_run_asks_for(
    redis_server: RedisServer, prefix: str
) -> None:
    """REDIS_PROTOCOL=2 (make test's RESP2 pass) reaches every connection the library
    opens (reads and writes, the backplane listener, its pub/sub fallback, lease-fill
    notifications), not only the ones a test builds itself: redis-py would otherwise
    run the pass in RESP3 without a word."""
    config = make_config(redis_server.url, prefix, {"book": {"key": "book:{id}"}})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, {"title": "t"})
        assert await cache.get_or_load("book", {"id": 1}, lambda: {"title": "x"}) == {
            "title": "t"
        }
        admin = aredis.Redis.from_url(redis_server.url)
        try:
            own = await admin.client_id()
            clients = [c for c in await admin.client_list() if int(c["id"]) != own]
        finally:
            await admin.aclose()
    assert len(clients) >= 3, clients  # the pool, the listener, the fallback subscriber
    assert {c["resp"] for c in clients} == {REDIS_PROTOCOL}, clients


def test_prefix_and_topic_unique(prefix: str, unique_topic: str) -> None:
    assert prefix.startswith("t") and prefix.endswith(":")
    assert unique_topic.startswith("test-")


def test_free_port_never_repeats() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50


async def test_redis_server_kill_pause_restart(redis_server: RedisServer) -> None:
    url, port = redis_server.url, redis_server.port
    client = aredis.Redis.from_url(url, socket_timeout=0.3, retry_on_timeout=False)
    try:
        await client.set("k", "v")
        redis_server.kill()
        assert not redis_reachable(url)
        redis_server.start()
        assert redis_server.port == port and redis_server.url == url
        await client.connection_pool.disconnect()  # pooled sockets died with the server
        assert await client.get("k") is None  # no persistence: a restart is empty
        await client.set("k", "v2")
        redis_server.pause()
        with pytest.raises((aredis.TimeoutError, asyncio.TimeoutError)):
            await client.get("k")
        redis_server.resume()
        await client.connection_pool.disconnect()  # drop the socket with a late reply queued
        assert await client.get("k") == b"v2"
        redis_server.stop()
        assert not redis_server.running
        redis_server.start()
        await client.connection_pool.disconnect()
        assert await client.ping()
    finally:
        await client.aclose()


def test_redis_password() -> None:
    with RedisServer(password="s3cr:t") as server:
        assert redis_reachable(server.url)
        assert not redis_reachable(f"redis://127.0.0.1:{server.port}/0")


@pytest.mark.parametrize("cls", [RedisServer, KafkaBroker])
def test_auto_port_moves_when_taken(cls: type[RedisServer | KafkaBroker]) -> None:
    server = cls()
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with server:
            assert server.port != taken and server.running


def test_a_cluster_node_whose_bus_port_is_taken_starts_on_other_ports() -> None:
    """A CI run failed setting up a cluster: a node's bus port (``--cluster-port``) was
    taken, and the retry moved only the main port, so it failed the same way."""
    servers = RedisClusterServers(3)
    node = servers.servers[1]
    bus = int(node.extra_args[node.extra_args.index("--cluster-port") + 1])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", bus))
        squatter.listen()
        with servers:
            assert all(server.running for server in servers.servers)


def test_start_failure_shows_log() -> None:
    server = RedisServer(extra_args=["--no-such-option", "1"])
    with pytest.raises(ServerStartError, match="last lines of"):
        server.start(timeout=5)
    server.close()


async def test_cluster_keys_spread_over_nodes(
    redis_cluster: RedisClusterServers | ExistingRedisCluster,
) -> None:
    assert len(redis_cluster.nodes) >= 3
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        keys = [f"book:{i}" for i in range(30)]
        for key in keys:
            await client.set(key, key, ex=60)
        nodes = [client.get_node_from_key(key) for key in keys]
        owners = {node.port for node in nodes if node is not None}
        assert len(owners) >= 3
        assert owners <= {port for _, port in redis_cluster.nodes}
        assert await client.get("book:7") == b"book:7"
        # A hash tag keeps a key and its lease in one slot (DESIGN §4).
        assert client.keyslot("{book:42}:lease") == client.keyslot("book:42")
    finally:
        await client.aclose()


async def test_kafka_group_consume_and_commit(kafka_bootstrap: str, unique_topic: str) -> None:
    assert kafka_reachable(kafka_bootstrap)
    await create_topic(kafka_bootstrap, unique_topic, partitions=4)
    await create_topic(kafka_bootstrap, unique_topic, partitions=4)  # exist_ok
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        assert await producer.partitions_for(unique_topic) == {0, 1, 2, 3}
        for i in range(3):
            await producer.send_and_wait(unique_topic, f"m{i}".encode(), key=f"k{i}".encode())
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        unique_topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=f"g-{unique_topic}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **FAST_GROUP_KWARGS,
    )
    await consumer.start()
    try:
        got: list[bytes] = []
        deadline = time.monotonic() + 15
        while len(got) < 3 and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            got += [m.value for msgs in batches.values() for m in msgs if m.value is not None]
        assert sorted(got) == [b"m0", b"m1", b"m2"]
        await consumer.commit()
        committed = {tp: await consumer.committed(tp) for tp in consumer.assignment()}
        assert sum(c or 0 for c in committed.values()) == 3
    finally:
        await consumer.stop()


async def test_kafka_broker_restart_same_port(kafka_broker: KafkaBroker) -> None:
    bootstrap = kafka_broker.bootstrap
    kafka_broker.kill()
    assert not kafka_reachable(bootstrap)
    kafka_broker.start()
    assert kafka_broker.bootstrap == bootstrap
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        md = await producer.send_and_wait("auto-created", b"x")  # auto-created on produce
        assert md.offset == 0
    finally:
        await producer.stop()


async def test_cluster_master_restart_rejoins() -> None:
    with RedisClusterServers(3) as cluster:
        victim = cluster.servers[1]
        victim.kill()
        victim.start()  # same port and nodes.conf: rejoins with its slots, data gone
        cluster.wait_ok(timeout=15)
        client = RedisCluster.from_url(cluster.url)
        try:
            for i in range(20):
                await client.set(f"k{i}", i)
            assert await client.get("k19") == b"19"
        finally:
            await client.aclose()
