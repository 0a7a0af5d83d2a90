"""The cluster-wide lease: one load per key for the whole fleet.

On an L2 miss a reader tries ``SET {key}:lease <token> NX PX lease_ttl``. The winner
loads and fills (see ``L2Store.fill``). Losers wait for the fill: they subscribe to the
key's fill channel (sharded in a cluster, ``_notify``) and get the envelope in the
notification; as a fallback for a lost
notification they re-read L2 after a jittered pause drawn uniformly from the policy's
``reread_pause`` range (never a fixed sleep, so waiters of many processes don't re-read in lock
step), and they retry the lease, so a winner that crashed or failed blocks nobody longer
than ``lease_ttl``. After ``max_wait`` a waiter gives up and loads by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from layered_cache._keys import fill_channel, lease_name
from layered_cache._l2 import BreakerOpen, L2Store, L2Unavailable, LeaseRefused
from layered_cache._notify import Notifier, Subscription

__all__ = ["ANNOUNCED", "LeaseResult", "LeaseWaiter", "bound_lease", "new_token"]

# The notification of a fill whose envelope was too large to send along (``_l2``): never
# a valid envelope itself.
ANNOUNCED = b""


def new_token() -> str:
    """A random lease token: proves ownership for the compare-and-delete release."""
    return os.urandom(12).hex()


@dataclass(frozen=True, slots=True)
class LeaseResult:
    """What waiting produced: our own lease (``token``), a filled value, or a timeout."""

    token: str | None = None
    data: bytes | None = None


class LeaseWaiter:
    def __init__(
        self,
        l2: L2Store,
        notifier: Notifier | None,
        rand: Callable[[float, float], float] = random.uniform,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._l2 = l2
        self._notifier = notifier
        self._rand = rand
        self._clock = clock
        # Set by the cache's close(): each wait ends at its next step, without another
        # Redis command (its client is being closed), and the live ones are woken.
        self.closed = False
        self._waiting: set[asyncio.Queue[bytes]] = set()

    def end_waits(self) -> None:
        """``close()``: every wait returns at once, as a timeout (``LeaseResult()``);
        its reader then raises the closed error rather than calling its loader."""
        self.closed = True
        for queue in self._waiting:
            queue.put_nowait(ANNOUNCED)

    def reopen(self) -> None:
        self.closed = False

    async def try_acquire(
        self, lease: str, lease_ttl: float, token: str | None = None
    ) -> str | None:
        """``token`` (a new one if None) if we got the lease, else None. A caller that
        may be cancelled passes its own: a cancel can land after the SET NX did, and
        only a token known beforehand lets it give that lease back."""
        token = token or new_token()
        try:
            won = await self._l2.acquire_lease(lease, token, max(1, int(lease_ttl * 1000)))
        except BreakerOpen as exc:  # nothing sent: its callers have no lease to give back
            raise LeaseRefused(str(exc)) from None
        return token if won else None

    async def wait_for_fill(
        self,
        key: str,
        lease: str,
        lease_ttl: float,
        reread_pause: tuple[float, float],
        max_wait: float,
        usable: Callable[[bytes | None], bool],
        token: str | None = None,
    ) -> LeaseResult:
        """Wait until ``usable(data)`` holds for a fill, we win the lease (taken with
        ``token``, see ``try_acquire``), or max_wait.

        Raises ``L2Unavailable`` if Redis fails meanwhile (the caller loads itself).
        """
        deadline = self._clock() + max_wait
        if self._notifier is None:
            return await self._poll(key, lease, lease_ttl, reread_pause, deadline, usable, token)
        # Subscribing is bounded like one silent pause (and never past max_wait).
        async with self._notifier.subscribe(
            fill_channel(key, self._l2.db), min(reread_pause[1], max_wait)
        ) as sub:
            self._waiting.add(sub.queue)
            try:
                return await self._notified(
                    sub, key, lease, lease_ttl, reread_pause, deadline, usable, token
                )
            finally:
                self._waiting.discard(sub.queue)

    async def _notified(
        self,
        sub: Subscription,
        key: str,
        lease: str,
        lease_ttl: float,
        reread_pause: tuple[float, float],
        deadline: float,
        usable: Callable[[bytes | None], bool],
        token: str | None,
    ) -> LeaseResult:
        """``wait_for_fill`` once subscribed: woken by the fill's message, or re-reading
        after each silent pause."""
        if self.closed:
            return LeaseResult()
        # Re-read once the subscription is confirmed: a fill that landed between our
        # lost SET NX and the SUBSCRIBE would otherwise go unnoticed.
        data = await self._l2.get(key)
        if usable(data):
            return LeaseResult(data=data)
        while not self.closed and (remaining := deadline - self._clock()) > 0:
            message = await sub.wait(min(self._rand(*reread_pause), remaining))
            if self.closed:
                break
            if message == ANNOUNCED:  # a large value: the fill landed, read it
                message = await self._l2.get(key)
            if message is not None and usable(message):
                return LeaseResult(data=message)
            if message is not None:
                continue
            result = await self._recheck(key, lease, lease_ttl, usable, token, deadline)
            if result is not None:
                return result
        return LeaseResult()

    async def _poll(
        self,
        key: str,
        lease: str,
        lease_ttl: float,
        reread_pause: tuple[float, float],
        deadline: float,
        usable: Callable[[bytes | None], bool],
        token: str | None,
    ) -> LeaseResult:
        while not self.closed and (remaining := deadline - self._clock()) > 0:
            await asyncio.sleep(min(self._rand(*reread_pause), remaining))
            if self.closed:
                break
            result = await self._recheck(key, lease, lease_ttl, usable, token, deadline)
            if result is not None:
                return result
        return LeaseResult()

    async def _recheck(
        self,
        key: str,
        lease: str,
        lease_ttl: float,
        usable: Callable[[bytes | None], bool],
        token: str | None,
        deadline: float,
    ) -> LeaseResult | None:
        """Fallback after a silent pause: re-read L2, then try to take over the lease,
        unless max_wait passed during the re-read: a waiter gives up within max_wait and
        one round trip (a slow Redis made it two: the GET, then the SET NX)."""
        data = await self._l2.get(key)
        if usable(data):
            return LeaseResult(data=data)
        if self._clock() >= deadline or self.closed:
            return None
        won = await self.try_acquire(lease, lease_ttl, token)
        if won is not None:
            return LeaseResult(token=won)
        return None


async def bound_lease(store: L2Store, key: str, lease_ttl: float) -> None:
    """A lease name holding something without a TTL (a value planted at ``{key}:lease``,
    a tool's leftover) is no lease of ours, and every miss of the key would wait
    ``max_wait`` for good: it gets the TTL a lease has. ``PEXPIRE ... NX`` sets one only
    where none is, so a lease of ours (it always has one) is untouched."""
    name = lease_name(key)
    with contextlib.suppress(L2Unavailable):
        await store.guard(store.client.pexpire(name, max(1, int(lease_ttl * 1000)), nx=True), name)
