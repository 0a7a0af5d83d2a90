"""Redis clients built from the config, and what counts as "Redis failed".

One place for the wiring the library, the daemon and the CLI share: client options
(timeouts, TLS, credentials, pool size), the plain node connection pub/sub needs in a
cluster, and the exception tuple every layer catches to fall back instead of crashing.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypeGuard
from urllib.parse import urlsplit, urlunsplit

import msgspec
import redis.asyncio as redis
from redis import __version__ as redis_py_version
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError

from layered_cache._config import BackplaneConfig, Duration, RedisConfig
from layered_cache._config.checks import host_and_port
from layered_cache._topology import RefreshingCluster

__all__ = [
    "MIN_REDIS_PY",
    "REDIS_FAILURES",
    "RedisClient",
    "as_single_node",
    "check_redis_py",
    "is_cluster",
    "is_redis_failure",
    "listener_connection",
    "make_client",
    "make_node_client",
    "ping_every_master",
    "raised_in_redis_py",
    "relay_client",
    "resurface_cancel",
    "stop_if_cancelled",
    "with_timeout",
]

RedisClient = redis.Redis | RedisCluster


def as_single_node(client: RedisClient) -> redis.Redis:
    """``client``, which the caller found is not a cluster client (``is_cluster``), typed
    as what it is (a TypeGuard narrows only the positive branch)."""
    assert not isinstance(client, RedisCluster)
    return client


def is_cluster(client: RedisClient) -> TypeGuard[RedisCluster]:
    """Whether ``client`` is a Redis Cluster client (modules other than this one and the
    store don't import redis-py's client classes)."""
    return isinstance(client, RedisCluster)

async def ping_every_master(client: RedisClient) -> None:
    """PING a single node; in a cluster ask every master of the slot map CLUSTER INFO at
    once (a cluster client's PING goes to its default node only) and raise
    ``ClusterDownError`` naming those that say other than ``cluster_state:ok`` (one
    that doesn't answer raises its own error). A failed node also makes the client
    refresh its slot map, so after a failover the promoted replica is asked next."""
    if not is_cluster(client):
        await client.ping()
        return
    replies = await client.execute_command("CLUSTER INFO", target_nodes=RedisCluster.PRIMARIES)
    failed = sorted(
        name
        for name, info in dict(replies).items()
        if not isinstance(info, dict) or info.get("cluster_state") != "ok"
    )
    if failed:
        raise ClusterDownError(f"cluster_state is not ok on {', '.join(failed)}")


# Everything that means "Redis could not answer": RedisClusterException is not a
# RedisError (e.g. "cannot be connected" while the cluster client re-discovers nodes).
REDIS_FAILURES = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


def raised_in_redis_py(exc: AttributeError) -> bool:
    """Whether redis-py itself raised ``exc``. Its async cluster client was seen to
    raise AttributeError from a connection torn down underneath a command ("'NoneType'
    object has no attribute 'writelines'"): for the cache, one more failed L2 operation.
    Only that origin counts: an AttributeError from our own code is a bug and must
    surface, not pass for "Redis unavailable"."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    return module == "redis" or module.startswith("redis.")


def resurface_cancel(task: asyncio.Task[Any] | None, requested_before: int) -> None:
    """Raise the ``CancelledError`` a Redis command swallowed.

    redis-py sends through ``asyncio.wait_for`` when a socket timeout is set. On Python
    3.11, ``wait_for`` returns the inner result when a cancellation arrives just as the
    send finishes, and the ``CancelledError`` is lost (CPython gh-86296, fixed in 3.12):
    a task looping on ``invalidate()`` ran on after ``cancel()``. The task still counts
    the request (``Task.cancelling()``), so an operation that returned normally while
    the count rose was cancelled underneath: cancellation takes effect here instead.
    ``asyncio.timeout`` blocks around us still work: they see this CancelledError as
    their own and turn it into TimeoutError."""
    if task is not None and task.cancelling() > requested_before:
        raise asyncio.CancelledError


def stop_if_cancelled() -> None:
    """For background loops that retry Redis failures: raise the ``CancelledError`` of a
    cancellation redis-py swallowed (``resurface_cancel``: a ``cancel()`` that lands as
    a read completes is lost on Python 3.11). The loop would otherwise catch the next
    failure and go on for ever: ``stop()`` gave up on it and ``asyncio.run`` hung at
    exit, cancelling a task that never ends (seen in ``make test-stress``). The task
    still counts the request (``Task.cancelling()``), so every iteration asks."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def is_redis_failure(exc: BaseException) -> bool:
    """``REDIS_FAILURES``, or an AttributeError redis-py raised: for loops that must
    outlive Redis trouble (backplane, fleet reports) but not hide our own bugs."""
    if isinstance(exc, AttributeError):
        return raised_in_redis_py(exc)
    return isinstance(exc, REDIS_FAILURES)


# redis-py 8.1's asyncio client turns its maintenance notifications (Redis Enterprise's
# push messages before a failover or a shard move) on by default for RESP3, and with them
# on its pool hands out a pooled connection without checking it first
# (redis/redis-py#4252, fixed in 8.2.0 by #4260): every connection Redis closed while it
# sat idle - a restart, a failover, the ``timeout`` setting - then failed one command,
# and a restart opened the breaker (tests/faults/test_redis_faults.py). On 8.1 they are
# turned off, so the pool checks again; the breaker and the timeouts already cover a
# maintenance's dropped connections. 8.0's asyncio client has neither the notifications
# nor the gap; 8.2 has both, fixed, and keeps its default.
def _skips_pool_check(version: str) -> bool:
    """Whether this redis-py's pool skips its check of a pooled connection while
    maintenance notifications are on (8.1.x)."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2]) == (8, 1)


def _client_kwargs(config: RedisConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": config.timeout,
        "socket_connect_timeout": config.connect_timeout,
        "max_connections": config.max_connections,
    }
    if _skips_pool_check(redis_py_version) and not config.cluster:
        from redis.maint_notifications import MaintNotificationsConfig

        kwargs["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    if config.username is not None:
        kwargs["username"] = config.username
    if config.password is not None:
        kwargs["password"] = config.password
    if config.url.startswith("rediss://"):
        for option in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            value = getattr(config, option)
            if value is not None:
                kwargs[option] = value
    return kwargs


# pyproject.toml's floor, and the oldest redis-py make test runs (its smoke pass): the
# asyncio client gained sharded pub/sub (PubSub.ssubscribe) and RedisCluster.publish in
# 8.0, which a cluster's fill notifications and announcement fallback use.
MIN_REDIS_PY = (8, 0)


def check_redis_py(version: str) -> None:
    """Refuse a redis-py older than ``MIN_REDIS_PY``. pip enforces the floor, but an
    install that bypassed it (``--no-deps``, a vendored copy, a pinned lock file) would
    otherwise fail later, mid-request, with errors that don't name the cause (an
    AttributeError at a cluster waiter's first subscribe)."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < MIN_REDIS_PY:
        wanted = ".".join(map(str, MIN_REDIS_PY))
        raise RuntimeError(
            f"layered_cache needs redis-py >= {wanted}, found {version}: "
            f"pip install 'redis>={wanted}'"
        )


def make_client(config: RedisConfig, *, caller_bounds_commands: bool = False) -> RedisClient:
    """A redis.asyncio client for the config: RedisCluster when ``cluster = true``.

    No client retries automatically: a retry would multiply the time a request waits
    on a sick Redis, and the breaker plus the loader are the fallback. In a cluster
    redis-py's retries also refreshed the slot map and closed every connection (to
    healthy masters too) on each attempt: a failover stalled every request for
    seconds (issue 21). The cluster client still follows MOVED/ASK (that is routing,
    not a retry) and refreshes its slot map in the background (``_topology``).

    ``caller_bounds_commands``: no socket timeout, the caller puts a deadline on every
    command it sends (single node only; ``listener_connection`` says why).
    """
    check_redis_py(redis_py_version)
    kwargs = _client_kwargs(config)
    if caller_bounds_commands:
        if config.cluster:
            raise ValueError("a cluster client keeps its socket timeout")
        kwargs["socket_timeout"] = None
    if config.cluster:
        seeds = [ClusterNode(*_host_port(node)) for node in config.nodes]
        return RefreshingCluster.from_url(
            config.url, startup_nodes=seeds, retry=Retry(NoBackoff(), 0), **kwargs
        )
    # The pool itself is not capped (redis-py 8 caps at 100 by default): a capped pool
    # either fails a burst ("Too many connections") or, as BlockingConnectionPool, costs
    # a lock and a timer per command on the hot path. L2Store bounds its concurrency
    # with a semaphore instead (``max_connections``).
    kwargs["max_connections"] = 2**31
    return redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 0), **kwargs)


def _host_port(node: str) -> tuple[str, int]:
    host, port = host_and_port(node)
    return host, int(port)


def make_node_client(
    config: RedisConfig, node: str | None = None, protocol: int | None = None
) -> redis.Redis:
    """A plain connection for pub/sub, to the URL's node or to ``node`` ("host:port",
    same scheme, credentials and TLS options). On a single node the fill notifications
    use the URL's node; in a cluster each master gets its own (sharded pub/sub stays
    within the slot's shard, ``_notify.ClusterFillNotifier``)."""
    # socket_timeout stays ``redis.timeout``: it bounds the connect handshake and every
    # command a waiter sends (SUBSCRIBE/UNSUBSCRIBE) on a hung Redis. The reader's
    # ``get_message(timeout=...)`` passes its own read timeout, which overrides it.
    url = config.url if node is None else _with_netloc(config.url, node)
    kwargs = _client_kwargs(config)
    if protocol is not None:
        kwargs["protocol"] = protocol
    return redis.Redis.from_url(url, **kwargs)


def _with_netloc(url: str, node: str) -> str:
    """``url`` pointing at ``node`` instead, keeping any user:password@ part."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{node}"))


def listener_connection(config: RedisConfig, backplane: BackplaneConfig) -> RedisClient:
    """The backplane listener's own client: a blocking XREAD holds a connection. With
    ``backplane.relay`` it is a plain connection to the relay (``_relay``), which serves
    XREAD whatever L2 is.

    On a single node or a relay, no socket timeout: the listener bounds each of its
    commands itself (``asyncio.timeout``, ``BackplaneListener``). redis-py wraps every
    send of a client that has a socket timeout in ``asyncio.wait_for``, a Task and three
    more event-loop iterations per command (five instead of two), which every instance
    pays on every wake of its listener (docs/benchmarks.md, "set()"). A cluster keeps one
    longer than the block time: its background slot-map refreshes use the client too."""
    if backplane.relay:
        return relay_client(backplane.relay, config, caller_bounds_commands=True)
    if config.cluster:
        return make_client(with_timeout(config, backplane.block + 1.0))
    return make_client(config, caller_bounds_commands=True)


def relay_client(
    url: str, config: RedisConfig, *, caller_bounds_commands: bool = False
) -> redis.Redis:
    """A connection to a backplane relay (an instance's listener, or a relay following
    another): ``config``'s timeouts (no socket timeout with ``caller_bounds_commands``),
    no credentials or TLS (the relay has neither), no retry (the callers reconnect with
    their own backoff), RESP2 (all the relay speaks, ``_resp``)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=None if caller_bounds_commands else config.timeout,
        socket_connect_timeout=config.connect_timeout,
        retry=Retry(NoBackoff(), 0),
        protocol=2,
    )


def with_timeout(config: RedisConfig, timeout: float) -> RedisConfig:
    """``config`` with another socket timeout: a blocking XREAD needs one longer than
    its block time, the daemon's deletes one that survives a busy node."""
    return msgspec.structs.replace(config, timeout=Duration(timeout))
