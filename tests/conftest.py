"""Fixtures for real servers; the logic lives in tests/servers.py.

Session fixtures share one server per run (fast); function fixtures (`redis_server`,
`kafka_broker`) give a test its own process to kill, pause or restart. `REDIS_URL`,
`REDIS_CLUSTER_URL` and `KAFKA_BOOTSTRAP` point the shared fixtures at existing services.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis import __version__ as redis_py_version
from redis.utils import HIREDIS_AVAILABLE

from layered_cache._hiredis import USE_HIREDIS
from tests.faults.reply_delay import ReplyDelayProxy
from tests.servers import (
    REDIS_PROTOCOL,
    REDIS_SERVER,
    ExistingRedisCluster,
    KafkaBroker,
    RedisClusterServers,
    RedisServer,
    S3Server,
    kafka_reachable,
    redis_reachable,
    with_protocol,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: long-running load test (make soak)")
    # make test's hiredis pass puts hiredis on PYTHONPATH; redis-py falls back to its
    # pure-Python parser without a word if the import fails, and the pass would then
    # test the parser the main pass already did.
    if os.environ.get("REDIS_PARSER") == "hiredis" and not HIREDIS_AVAILABLE:
        raise pytest.UsageError("REDIS_PARSER=hiredis, but redis-py can't import hiredis")
    if os.environ.get("REDIS_PARSER") == "hiredis" and not USE_HIREDIS:
        raise pytest.UsageError("REDIS_PARSER=hiredis, but the library's parser isn't (< 3.2?)")
    # Likewise the client pass's redis-py: PYTHONPATH must have put it first.
    wanted = os.environ.get("REDIS_PY_VERSION")
    if wanted and wanted != redis_py_version:
        raise pytest.UsageError(f"REDIS_PY_VERSION={wanted}, but redis-py is {redis_py_version}")


def pytest_report_header() -> str:
    parser = "hiredis" if HIREDIS_AVAILABLE else "its Python parser"
    return (
        f"redis fixtures start: {REDIS_SERVER} (REDIS_SERVER=redis|valkey), spoken to in "
        f"RESP{REDIS_PROTOCOL} (REDIS_PROTOCOL); redis-py {redis_py_version}, replies "
        f"parsed by {parser}"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by the services they use, so `-m "not cluster"` etc. just work."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "redis_cluster" in names:
            item.add_marker(pytest.mark.cluster)
        if names & {"kafka_bootstrap", "kafka_broker", "durable_kafka_broker"}:
            item.add_marker(pytest.mark.kafka)


def _external(var: str, reachable: bool) -> str | None:
    url = os.environ.get(var)
    if url and not reachable:
        warnings.warn(f"{var}={url} is not reachable; starting an own server", stacklevel=2)
    return url if url and reachable else None


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis shared by the session (use `prefix` for keys)."""
    env = os.environ.get("REDIS_URL", "")
    if url := _external("REDIS_URL", bool(env) and redis_reachable(env)):
        yield with_protocol(url)
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A Redis of the test's own, to kill / pause / restart (`.start()` keeps the port)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers | ExistingRedisCluster]:
    """A 3-master Redis Cluster: `.url`, `.nodes`, `.servers` (empty if external)."""
    env = os.environ.get("REDIS_CLUSTER_URL", "")
    if url := _external("REDIS_CLUSTER_URL", bool(env) and redis_reachable(env)):
        yield ExistingRedisCluster(url)
        return
    with RedisClusterServers(3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """Bootstrap servers of a Kafka-protocol broker shared by the session."""
    env = os.environ.get("KAFKA_BOOTSTRAP", "")
    if url := _external("KAFKA_BOOTSTRAP", bool(env) and kafka_reachable(env)):
        yield url
        return
    with KafkaBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def kafka_broker() -> Iterator[KafkaBroker]:
    """A broker of the test's own, to restart (memory storage: a restart empties it)."""
    with KafkaBroker() as broker:
        yield broker


@pytest.fixture
def durable_kafka_broker() -> Iterator[KafkaBroker]:
    """A broker of the test's own that keeps its data across restarts (S3 storage on a
    local moto server), for tests that restart the broker under the daemon."""
    with S3Server() as s3, KafkaBroker(s3=s3) as broker:
        yield broker


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client of the suite's Redis, to look at what the cache really wrote."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    """A unique key prefix, e.g. `t3f9a1c2:`, so tests sharing a Redis never collide."""
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def unique_topic() -> str:
    """A fresh topic name (tansu auto-creates on produce; use create_topic for N partitions)."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def late_replies(redis_url: str) -> AsyncIterator[ReplyDelayProxy]:
    """A proxy to ``redis_url`` that makes chosen replies late (``ReplyDelayProxy``)."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = await ReplyDelayProxy(port).start()
    yield proxy
    await proxy.stop()
