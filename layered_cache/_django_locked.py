"""Django's read-modify-write calls (``add``, ``incr``/``decr``, ``touch``) made
atomic across processes: each runs holding the key's lock (``{key}:lock``), so no other
such call on the key, in any process, runs between its read and its write; and the
key's lease (``{key}:lease``, the stampede protection's), so none runs while a
``get_or_set`` of the key loads, nor a load starts during it.

Two names because a write revokes the lease (``set``: a fill in flight must not land an
older value after it): as the only lock, a ``set`` racing an ``incr`` released it to the
next ``incr``, which read the reset value while the first was still to write, and the
first's write then lost the second's increment. Nothing revokes the lock but its expiry.

Redis has ``SET NX`` and ``INCRBY`` for this, but the value at a cache key is an envelope
every layer reads (and its expiry is inside it), so the step is: take the lock, then the
lease, read the key from L2 (never L1: another process's write may not have reached
this L1 yet), decide, write through the namespace (L2, replicas, the backplane),
release both.

What it does not exclude: a plain ``set``/``delete`` racing the step (last writer wins,
as with any two writes). A lock or lease held by a crashed process expires by itself
after ``stampede.lease_ttl``; a caller that cannot get both within ``lease_ttl`` + 1 s
goes ahead without the one it lacks and logs ``django_lock_timeout``.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import structlog

from layered_cache._cache import LayeredCache
from layered_cache._codec import CodecError
from layered_cache._django_values import Entry
from layered_cache._giveback import GiveBacks
from layered_cache._keys import lease_name, lock_name
from layered_cache._l2 import BreakerOpen, L2Store, L2Unavailable
from layered_cache._policy import Policy

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
    """``step(current)`` holding the key's lock and lease; ``current`` is the live entry
    in L2 or None (absent, expired by its own timeout, or past the namespace's L2
    freshness)."""
    policy = cache.namespace(namespace).policy
    key = cache.key(namespace, fields)
    token = secrets.token_hex(8)
    # The lock first: callers queue on it, and only its holder competes with loads for
    # the lease. One deadline for both: the documented wait is lease_ttl + 1 s.
    deadline = time.monotonic() + policy.lease_ttl + 1.0
    wanted, held = [lock_name(key), lease_name(key)], list[str]()
    try:
        await _take(cache._parts.store, wanted, token, policy, deadline, held)
        if len(held) < len(wanted):
            missing = [name.rsplit(":", 1)[1] for name in wanted if name not in held]
            _log.warning("django_lock_timeout", namespace=namespace, key=key, missing=missing)
        result = await step(await _current(cache, namespace, key))
    except asyncio.CancelledError:
        # A cancelled caller (the sync API's timeout) can't await the release: it goes
        # in the background, and close() waits for it.
        cache._rt.tasks.spawn_orphan(_release(cache._rt.give_backs, held, token))
        raise
    except BaseException:  # also when taking the lease failed: the lock is not left to expire
        await _give_back(cache, held, token)
        raise
    await _give_back(cache, held, token)
    return result


async def _give_back(cache: LayeredCache, names: list[str], token: str) -> None:
    """``_release``, run on by itself if our caller is cancelled meanwhile."""
    await cache._rt.tasks.to_completion(_release(cache._rt.give_backs, names, token))


async def _take(
    store: L2Store, wanted: list[str], token: str, policy: Policy, deadline: float,
    held: list[str],
) -> None:
    """Take each of ``wanted`` in turn; ``held`` gets each we hold or may hold: one whose
    ``SET NX`` reply never came (a timeout, a cancel) may have landed all the same, and
    kept it blocks every ``incr`` and every load of the key, fleet-wide, for
    ``lease_ttl``. One the open breaker refused was never sent."""
    for name in wanted:
        try:
            taken = await _acquire(store, name, token, policy, deadline)
        except BreakerOpen:
            raise  # refused unsent: nothing of ours there
        except BaseException:
            held.append(name)  # our token or nobody's: the compare-and-delete is safe
            raise
        if taken:
            held.append(name)


async def _release(give_backs: GiveBacks, names: list[str], token: str) -> None:
    """Compare-and-delete each of ``names`` at once, past an open breaker too (the
    timeouts that make a step give its names back are the ones that open it:
    ``_giveback``); one Redis could not release expires by itself after ``lease_ttl``."""
    released = await asyncio.gather(
        *(give_backs.release(name, token) for name in names), return_exceptions=True
    )
    for outcome in released:
        if isinstance(outcome, BaseException) and not isinstance(outcome, L2Unavailable):
            raise outcome


async def _current(cache: LayeredCache, namespace: str, key: str) -> Entry | None:
    """The live entry at ``key`` in L2, or None."""
    policy = cache.namespace(namespace).policy
    data = await cache._parts.store.get(key)
    try:
        envelope = policy.codec.decode(data) if data is not None else None
    except CodecError:
        envelope = None  # a foreign value at the key: absent, the write replaces it
    now = cache._rt.clock()  # Redis' time, as envelopes are stamped (``_redisclock``)
    fresh = envelope is not None and envelope.soft_expiry > now
    current = envelope.value if envelope is not None and fresh else None
    return current if alive(current, now) else None


async def _acquire(
    store: L2Store, name: str, token: str, policy: Policy, deadline: float
) -> bool:
    """Poll for ``name`` (steps hold it for a few round trips; a get_or_set load holds
    the lease while its loader runs) with jittered pauses until ``deadline``; one try
    even past it (the lease after a lock that took the whole wait)."""
    ttl_ms = max(1, int(policy.lease_ttl * 1000))
    while not await store.acquire_lease(name, token, ttl_ms):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(random.uniform(0.002, 0.02))
    return True
