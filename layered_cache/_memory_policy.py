"""What Redis does when it is full, read at start-up and by ``layered-cache doctor``.

``maxmemory-policy`` decides what a full Redis does to the library's names: under
``noeviction`` it refuses writes (fills fail and fall back to the loader; the backplane
stream refuses announcements, which then go over pub/sub: ``_fallback``), under
``allkeys-*`` it may evict the backplane stream (a gap: every instance clears its L1
once), a lease (at most one extra load), a tag version (its entries read as stale) or a
replica (reads fall back to the base key). Nothing breaks either way, but an operator
should know which of these to expect, so each master's policy is logged once at start.

Two cases are worse than "nothing breaks", and are said as such:

- No memory limit (``maxmemory 0``, a fresh redis-server's and many charts' default):
  Redis grows with every name written until the OOM killer ends it, losing every value,
  lease and the backplane stream at once. ``doctor`` called that "nothing to warn about".
- ``allkeys-*`` with ``tags = true`` namespaces: the tags' loading set has no TTL and may
  be evicted while a tagged load is in flight; an ``invalidate_tag`` in that window
  revokes nothing, and the load's value, read before the change, lands and is served
  (docs/tags.md, "Limits"). ``volatile-*`` never evicts it (every value, replica, lease
  and tag version the library writes has a TTL, the loading set has none), and
  ``noeviction`` evicts nothing: the tagged namespaces are named with that risk.

Managed services (ElastiCache, Memorystore, ...) often refuse ``CONFIG``: then the
policy is unknown, said once at info level, and the cache starts anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError

from layered_cache._clients import REDIS_FAILURES, RedisClient
from layered_cache._config import Config

__all__ = [
    "MemoryPolicy",
    "consequence",
    "log_memory_policies",
    "read_memory_policies",
    "refused_for_memory",
    "tagged_namespaces",
    "tagged_risk",
]

_log = structlog.get_logger("layered_cache")

_NOEVICTION = (
    "when Redis reaches maxmemory it refuses writes: fills fail (reads fall back to the "
    "loader, without a fleet-wide lease) and the backplane stream refuses invalidation "
    "announcements, which then go over pub/sub (reaching only the instances connected at "
    "that moment; see docs/operations.md)"
)
_ALLKEYS = (
    "when Redis reaches maxmemory it may evict any name, the library's own included: an "
    "evicted backplane stream makes every instance clear its L1 once, an evicted lease "
    "costs at most one extra load, an evicted tag version makes its entries reload, an "
    "evicted replica makes reads fall back to the base key"
)
_NO_LIMIT = (
    "no memory limit (maxmemory 0): Redis grows with every name written until the host "
    "runs out of memory and the OOM killer ends it, losing every value, lease and the "
    "backplane stream at once; set maxmemory (and a policy: docs/operations.md, Redis)"
)
_TAGGED = (
    "tagged namespaces {names}: Redis may evict the tags' loading set (it has no TTL) "
    "while a tagged load is in flight, and an invalidate_tag in that window revokes "
    "nothing: that load's value, read before the change, lands and is served stale until "
    "it expires or its tag is invalidated again; use volatile-lfu (it never evicts the "
    "loading set) or noeviction, or accept that window (docs/tags.md, Limits)"
)
_VOLATILE = (
    "when Redis reaches maxmemory it evicts only names with a TTL (values, replicas, "
    "leases); once none is left it refuses writes as under noeviction"
)


class MemoryPolicy(msgspec.Struct, frozen=True):
    """One master's ``maxmemory-policy`` and ``maxmemory`` (None: CONFIG refused)."""

    node: str  # "host:port" of a cluster master; "" for a single Redis
    policy: str | None
    maxmemory: int | None  # bytes; 0 = no limit
    error: str | None = None  # why CONFIG GET failed

    @property
    def consequence(self) -> str | None:
        return consequence(self.policy, self.maxmemory)

    def tagged_risk(self, tagged: Sequence[str]) -> str | None:
        return tagged_risk(self.policy, self.maxmemory, tagged)


def consequence(policy: str | None, maxmemory: int | None) -> str | None:
    """What a full Redis does to the cache under ``policy``, or that Redis has no limit
    to be full at; None when nothing to say (the policy unknown)."""
    if policy is None or maxmemory is None:
        return None
    if maxmemory == 0:
        return _NO_LIMIT
    if policy == "noeviction":
        return _NOEVICTION
    if policy.startswith("allkeys-"):
        return _ALLKEYS
    if policy.startswith("volatile-"):
        return _VOLATILE
    return None


def tagged_risk(policy: str | None, maxmemory: int | None, tagged: Sequence[str]) -> str | None:
    """The stale-value risk of the ``tagged`` namespaces under ``policy`` (module doc);
    None when they have none: no eviction of names without a TTL, or no limit."""
    if not tagged or policy is None or not maxmemory or not policy.startswith("allkeys-"):
        return None
    return _TAGGED.format(names=", ".join(sorted(tagged)))


def tagged_namespaces(config: Config) -> list[str]:
    """The namespaces whose entries may carry tags (``tags = true``)."""
    return sorted(name for name, namespace in config.namespaces.items() if namespace.tags)


def refused_for_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or the Redis error it wraps: ``L2Unavailable``) is a write
    refused because Redis is full ("OOM command not allowed", noeviction)."""
    cause = exc if isinstance(exc, OutOfMemoryError) else exc.__cause__
    return isinstance(cause, OutOfMemoryError)


def _value(reply: Any, name: str) -> str | None:
    """CONFIG GET's reply as a dict (redis-py's callback) or a flat [name, value] list."""
    if isinstance(reply, dict):
        found = reply.get(name, reply.get(name.encode()))
    elif isinstance(reply, list | tuple) and len(reply) >= 2:
        found = reply[1]
    else:
        found = None
    if found is None:
        return None
    return found.decode() if isinstance(found, bytes) else str(found)


async def _read_one(node: str, conn: Any) -> MemoryPolicy:
    try:
        policy = _value(
            await conn.execute_command("CONFIG", "GET", "maxmemory-policy"), "maxmemory-policy"
        )
        limit = _value(await conn.execute_command("CONFIG", "GET", "maxmemory"), "maxmemory")
    except REDIS_FAILURES as exc:
        return MemoryPolicy(node, None, None, f"{type(exc).__name__}: {exc}")
    return MemoryPolicy(node, policy, int(limit) if limit is not None else None)


async def read_memory_policies(client: RedisClient) -> list[MemoryPolicy]:
    """Every master's policy (one entry for a single Redis). Never raises for Redis
    failures: a master that refuses or fails has ``error`` set."""
    if isinstance(client, RedisCluster):
        try:
            await client.initialize()
            nodes = client.get_primaries()
        except REDIS_FAILURES as exc:
            return [MemoryPolicy("", None, None, f"{type(exc).__name__}: {exc}")]
        return list(await asyncio.gather(*(_read_one(n.name, n) for n in nodes)))
    return [await _read_one("", client)]


def log_policy(found: MemoryPolicy, tagged: Sequence[str] = ()) -> None:
    extra: dict[str, str] = {"node": found.node} if found.node else {}
    if found.error is not None:
        _log.info("redis_memory_policy_unknown", error=found.error, **extra)
        return
    if risk := found.tagged_risk(tagged):
        extra["tagged_risk"] = risk
    text = found.consequence
    if text is None:
        _log.info("redis_memory_policy", policy=found.policy, maxmemory=found.maxmemory, **extra)
        return
    _log.warning(
        "redis_memory_policy",
        policy=found.policy,
        maxmemory=found.maxmemory,
        consequence=text,
        **extra,
    )


async def log_memory_policies(
    client: RedisClient, seconds: float, tagged: Sequence[str] = ()
) -> list[MemoryPolicy]:
    """Read and log every master's policy, bounded by ``seconds`` (start-up must not
    wait on a sick Redis: then nothing is logged but one info line). ``tagged``: the
    config's ``tags = true`` namespaces, named with their risk under ``allkeys-*``."""
    try:
        found = await asyncio.wait_for(read_memory_policies(client), seconds)
    except TimeoutError:
        _log.info("redis_memory_policy_unknown", error="timeout")
        return []
    for policy in found:
        log_policy(policy, tagged)
    return found
