"""``clear()`` of the Django backend: every key of its namespace, in bounded steps.

A Django namespace may hold any number of keys (``cache_page`` entries, cached sessions:
100k and more), and each is invalidated on its own (its replicas, its lease, every
process's L1: a script and a backplane entry per key, a few thousand keys a second).
Run as one sync call, ``clear()`` was bounded by ``OPTIONS["timeout"]`` as a whole: a
large namespace could not be cleared, and the call failed half done. So the calling
thread drives the loop here: each ``SCAN`` page, and each batch of invalidations, is a
call of its own on the cache's loop, bounded by the timeout; the whole is bounded only
by the number of keys (docs/django.md, ``clear``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from redis.asyncio.cluster import RedisCluster

from layered_cache._cache import LayeredCache
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache._loopthread import SyncTimeoutError
from layered_cache._policy import Policy
from layered_cache._templates import parse_template

__all__ = ["clear_namespace"]

SCAN_COUNT = 1000  # names a SCAN call looks at (Redis' COUNT hint)
BATCH = 100  # keys invalidated concurrently in one call

Fields = dict[str, str]
# ``LayeredCacheBackend._call``: run ``make(cache, namespace)`` on the loop, bounded.
Call = Callable[[Callable[[LayeredCache, str], Awaitable[Any]], str], Any]


class Scan(msgspec.Struct, frozen=True):
    """Where the SCAN stands: each master's cursor (by host:port; ``""`` for a single
    node) until it has answered 0. ``None``: not begun."""

    pending: dict[str, int] | None = None

    @property
    def done(self) -> bool:
        return self.pending == {}


def clear_namespace(call: Call, timeout: float | None) -> int:
    """Invalidate every key of the namespace, one bounded call per step; the number of
    keys invalidated. A step that times out raises ``SyncTimeoutError`` saying which
    step and how far the clear got: the keys not reached yet remain."""
    scan, cleared, step = Scan(), 0, "a SCAN page"
    try:
        while not scan.done:
            step = "a SCAN page"
            scan, found = call(functools.partial(scan_page, scan=scan), "django clear (SCAN)")
            for start in range(0, len(found), BATCH):
                batch = found[start : start + BATCH]
                step = f"invalidating {len(batch)} keys"
                call(functools.partial(invalidate_all, batch=batch), "django clear")
                cleared += len(batch)
    except SyncTimeoutError as exc:
        raise SyncTimeoutError(
            f"django clear(): {step} did not finish within {timeout} s (OPTIONS['timeout'] "
            f"bounds each step of a clear, not the whole); {cleared} keys were cleared "
            "before it, the others remain: call clear() again to finish"
        ) from exc
    return cleared


async def scan_page(
    cache: LayeredCache, namespace: str, scan: Scan
) -> tuple[Scan, list[Fields]]:
    """One SCAN call on one master: the scan after it, and the keys of the names found
    (replica names, ``key#i``, parse to None: deleted with their key). The first step
    also drops all of this process's L1 of the namespace, which may hold what Redis no
    longer does (evicted), and the loads in flight here with it."""
    policy = cache.namespace(namespace).policy
    store = cache._parts.store
    pending = _begin(store, policy) if scan.pending is None else dict(scan.pending)
    if not pending:
        return Scan({}), []
    node, cursor = next(iter(pending.items()))
    cursor, names = await _scan(store, node, cursor, _pattern(policy, namespace))
    if cursor:
        pending[node] = cursor
    else:
        del pending[node]
    parsed = (policy.template.parse(_text(raw)) for raw in names)
    return Scan(pending), [fields for fields in parsed if fields is not None]


async def invalidate_all(cache: LayeredCache, namespace: str, batch: list[Fields]) -> None:
    """Invalidate ``batch`` (L2, replicas and leases, then every L1 by the backplane)."""
    await asyncio.gather(*(cache.invalidate(namespace, fields) for fields in batch))


def _begin(store: L2Store, policy: Policy) -> dict[str, int]:
    if policy.l1 is not None:
        policy.l1.clear()
    client = store.client
    if isinstance(client, RedisCluster):
        return {node.name: 0 for node in client.get_primaries()}
    return {"": 0}


async def _scan(store: L2Store, node: str, cursor: int, pattern: str) -> tuple[int, list[Any]]:
    """SCAN ``node`` from ``cursor``: the next cursor (0: done) and the names found.
    Under the breaker (``L2Store.guard``), as every other write of the backend: a Redis
    failure is ``L2Unavailable``, not redis-py's own error, and an open breaker spares
    the call the timeout. The shared breaker: a SCAN names no key to pick a master's by."""
    client = store.client
    if not isinstance(client, RedisCluster):
        found, names = await store.guard(client.scan(cursor, match=pattern, count=SCAN_COUNT))
        return int(found), list(names)
    target = client.get_node(node_name=node)
    if target is None:
        raise L2Unavailable(f"Redis {node} left the cluster during clear(): call clear() again")
    # A cluster's SCAN answers per node: ({host:port: cursor}, names).
    scan = client.scan(cursor, match=pattern, count=SCAN_COUNT, target_nodes=target)
    cursors, names = await store.guard(scan)
    return int(cursors[node]), list(names)


def _pattern(policy: Policy, namespace: str) -> str:
    """Every name of the namespace: its prefix and the template's lead literal (distinct
    per namespace, ``_keys``); a foreign name under it is skipped by ``parse``."""
    template = policy.template
    lead = parse_template(namespace, template.template)[0][0]
    return template.prefix + lead + "*"


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
