"""Django's read-modify-write calls (``add``, ``incr``/``decr``, ``touch``) made
atomic across processes: each runs under the key's lease (``{key}:lease``, the lock the
stampede protection already uses), so no other such call on the key, in any process,
runs between its read and its write.

Redis has ``SET NX`` and ``INCRBY`` for this, but the value at a cache key is an envelope
every layer reads (and its expiry is inside it), so the step is: take the lease, read
the key from L2 (never L1: another process's write may not have reached this L1 yet),
decide, write through the namespace (L2, replicas, the backplane), release.

What it does not exclude: a plain ``set``/``delete`` racing the step (last writer wins,
as with any two writes; ``delete`` also revokes the lease). A lease held by a crashed
process expires by itself after ``stampede.lease_ttl``; a caller that cannot get the
lease within ``lease_ttl`` + 1 s goes ahead without it and logs ``django_lock_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import structlog

from layered_cache._cache import LayeredCache
from layered_cache._codec import CodecError
from layered_cache._django_values import Entry
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable

__all__ = ["locked"]

T = TypeVar("T")
_log = structlog.get_logger("layered_cache")


def alive(entry: Entry | None, now: float) -> bool:
    """Whether ``entry`` is there and within its own Django timeout at ``now`` (the
    cache's clock: Redis' time, in which ``get_backend_timeout`` stamped it)."""
    return entry is not None and (entry.expires_at is None or entry.expires_at > now)


async def locked(
    cache: LayeredCache,
    namespace: str,
    fields: Mapping[str, str],
    step: Callable[[Entry | None], Awaitable[T]],
) -> T:
    """``step(current)`` under the key's lease; ``current`` is the live entry in L2 or
    None (absent, expired by its own timeout, or past the namespace's L2 freshness)."""
    policy = cache.namespace(namespace).policy
    store = cache._parts.store
    key = cache.key(namespace, fields)
    lease, token = lease_name(key), secrets.token_hex(8)
    held = await _acquire(store.acquire_lease, lease, token, policy.lease_ttl)
    if not held:
        _log.warning("django_lock_timeout", namespace=namespace, key=key)
    try:
        data = await store.get(key)
        try:
            envelope = policy.codec.decode(data) if data is not None else None
        except CodecError:
            envelope = None  # a foreign value at the key: absent, the write replaces it
        now = cache._rt.clock()  # Redis' time, as envelopes are stamped (``_redisclock``)
        fresh = envelope is not None and envelope.soft_expiry > now
        current = envelope.value if envelope is not None and fresh else None
        return await step(current if alive(current, now) else None)
    finally:
        if held:
            with contextlib.suppress(L2Unavailable):
                await store.release(lease, token)


async def _acquire(
    acquire: Callable[[str, str, int], Awaitable[bool]], lease: str, token: str, ttl: float
) -> bool:
    """Poll for the lease (steps hold it for a few round trips; a get_or_set load holds
    it while its loader runs) with jittered pauses, for at most ``ttl`` + 1 s."""
    deadline = time.monotonic() + ttl + 1.0
    while not await acquire(lease, token, max(1, int(ttl * 1000))):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(random.uniform(0.002, 0.02))
    return True
