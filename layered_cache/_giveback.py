"""Leases given back past an open breaker.

A request whose lease round trip timed out gives its lease back (its ``SET NX`` may
have landed, only its reply was late): kept, the lease makes every reader of the key,
fleet-wide, wait ``max_wait`` for a fill nobody runs. But the timeouts that call for
these give-backs are the very ones that open the breaker (three requests stalled
together: the third opens it), and the breaker then refused each give-back at once:
the leases stayed for their whole ``lease_ttl`` on a Redis that had taken them.

So a give-back the open breaker refuses (nothing was sent) goes anyway, past it: a
compare-and-delete of our own token is harmless whatever state Redis is in. It neither
asks the breaker nor tells it the outcome: it is not a probe, and a Redis that answers
it but still stalls the request path must not close the breaker, nor one that fails it
keep it open longer. Bounded: the refused give-backs are pooled and one round trip at
a time carries every one pending (at most ``CHUNK_ITEMS``), so a Redis that is really
down costs one ``redis.timeout`` (or ``connect_timeout``) in the background at a time,
however many requests gave leases back; a round trip that fails drops what is pending
(Redis is failing: the leases expire by themselves, ``lease_ttl``), and beyond
``MAX_PENDING`` waiting ones the rest are left to expire too. A give-back the breaker
lets through goes the ordinary way (``L2Store.release``, ``L2Batch.release_many``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from layered_cache._chunks import CHUNK_ITEMS
from layered_cache._clients import REDIS_FAILURES, raised_in_redis_py
from layered_cache._l2 import BreakerOpen, L2Store
from layered_cache._scripts import RELEASE_SCRIPT

__all__ = ["MAX_PENDING", "GiveBacks"]

MAX_PENDING = 10 * CHUNK_ITEMS


class GiveBacks:
    def __init__(self, store: L2Store, spawn: Callable[[Awaitable[Any]], None]) -> None:
        self._store = store
        # ``BackgroundTasks.spawn_orphan``: close() waits for a give-back under way.
        self._spawn = spawn
        self._pending: dict[tuple[str, str], None] = {}  # (lease, token), in order
        self._sender: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def release(self, lease: str, token: str) -> None:
        """``L2Store.release``, or past the breaker if it refused it (``L2Unavailable``:
        it failed, the lease expires by itself)."""
        try:
            await self._store.release(lease, token)
        except BreakerOpen:
            self.past_breaker([lease], token)

    def past_breaker(self, leases: Iterable[str], token: str) -> None:
        """Give ``leases`` (held by ``token``, if at all) back past the open breaker that
        refused it, in the background."""
        for lease in leases:
            if len(self._pending) >= MAX_PENDING:
                break  # left to expire (``lease_ttl``): a bound on what we hold for Redis
            self._pending[(lease, token)] = None
        sender = self._sender
        if not self._pending or (
            sender is not None
            and not sender.done()
            and sender.get_loop() is asyncio.get_running_loop()
        ):
            return  # the round trip under way sends ours next
        self._sender = asyncio.ensure_future(self._send())
        self._spawn(self._sender)

    async def _send(self) -> None:
        while self._pending:
            pairs = list(self._pending)[:CHUNK_ITEMS]
            for pair in pairs:
                del self._pending[pair]
            try:
                await self._release(pairs)
            except REDIS_FAILURES:
                self._pending.clear()  # Redis failing: the rest would wait a timeout too
            except AttributeError as exc:
                if not raised_in_redis_py(exc):
                    raise  # our bug, not Redis: it must surface
                self._pending.clear()

    async def _release(self, pairs: list[tuple[str, str]]) -> None:
        """RELEASE_SCRIPT for each pair, one pipeline (split per node in a cluster),
        bounded as any command (socket timeouts; a cluster's ``L2Store.bounded``) and
        under the concurrency bound, never under a breaker."""
        store = self._store
        pipe = store.client.pipeline(transaction=False)
        for lease, token in pairs:
            pipe.eval(RELEASE_SCRIPT, 1, lease, token)
        async with store.slots:
            # A lease in a migrating slot, a foreign value: its reply is an error, the
            # others are released all the same.
            await store.bounded(pipe.execute(raise_on_error=False))
