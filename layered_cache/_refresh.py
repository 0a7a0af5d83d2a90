"""Background work a read starts: XFetch early refreshes and copying a newly hot key's
value to its replicas. Both run under the key's lease, so the fleet does each at most
once per key at a time; the in-process sets below only spare the lease round trip when
this process already has one running. They are separate sets: a refresh and a copy are
unrelated jobs (the lease serialises them anyway). Also here: the read of the base key
that a hot ``get()`` falls back to when the replica gave no fresh value, since it is
what starts such a copy.

A ``cached`` function with ``ignore=`` is never refreshed early (``RequestBound``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from layered_cache import _replicas as replicas
from layered_cache._codec import Envelope
from layered_cache._fills import Fills
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable, LeaseRefused
from layered_cache._loader_call import RequestBound
from layered_cache._miss import MissPath, Read
from layered_cache._policy import Policy
from layered_cache._runtime import Runtime
from layered_cache._stampede import new_token
from layered_cache._xfetch import should_refresh_early

__all__ = ["Refresher"]

class Refresher:
    def __init__(self, policy: Policy, fills: Fills, miss: MissPath, runtime: Runtime) -> None:
        self._policy = policy
        self._fills = fills
        self._miss = miss
        self._rt = runtime
        self._refreshing: set[str] = set()  # keys with an XFetch refresh in flight here
        self._copying: set[str] = set()  # keys whose replicas this process is filling

    def maybe_refresh_early(
        self,
        read: Read,
        envelope: Envelope[Any],
        loader: Callable[[], Awaitable[Any]],
        now: float,
    ) -> None:
        policy, key = self._policy, read.key
        if policy.beta <= 0 or key in self._refreshing or policy.expiry_of is not None:
            # Values with an expiry of their own (a Django entry's timeout) end there:
            # refreshing one early would call its loader (``get_or_set``'s default)
            # again while the value is present, which Django never does.
            return
        if isinstance(loader, RequestBound):
            # Its arguments are a finished request's (``RequestBound``): reloaded at
            # expiry instead, by a request with arguments of its own.
            return
        if envelope.tags and read.tags_of is None:
            # A reader that gives no tags (a ``cached`` function) can't compute the
            # tags of a tagged entry's new value: its refresh wrote the entry untagged,
            # and it outlived ``invalidate_tag``. Tagged readers refresh it.
            return
        if not should_refresh_early(
            now, envelope.soft_expiry, envelope.delta, policy.beta, self._rt.rand
        ):
            return
        self._refreshing.add(key)
        self._rt.tasks.spawn(self._refresh(read, envelope, loader))

    async def _refresh(
        self, request: Read, envelope: Envelope[Any], loader: Callable[[], Awaitable[Any]]
    ) -> None:
        """XFetch refresh under the lease: one per key for the whole fleet."""
        policy, key = self._policy, request.key
        try:
            token = await self._leased(key, envelope)
            if token is None:
                return
            policy.stats.early_refresh += 1
            seq = policy.l1.begin_read() if policy.l1 is not None else None
            # No stale value: a refresh serves no caller, so its loader failing is a
            # load_error, not a stale value served (stale_served and its warning).
            read = Read(key, seq, None, request.tags_of)
            with contextlib.suppress(Exception):
                await self._miss.load_and_fill(read, token, loader, refresh=True)
        finally:
            self._refreshing.discard(key)

    async def _leased(self, key: str, envelope: Envelope[Any]) -> str | None:
        """The key's lease for a refresh; None if someone else is refreshing (or
        loading) it, a refresh landed meanwhile, or Redis failed."""
        mine = new_token()
        try:
            token = await self._rt.leases.try_acquire(lease_name(key), self._policy.lease_ttl, mine)
            if token is not None and await self._refreshed_meanwhile(key, envelope):
                await self._miss.release(key, token)
                return None
            return token
        except L2Unavailable as exc:  # the lease may be ours: ``MissPath.load_under_lease``
            self._policy.stats.redis_error += 1
            if not isinstance(exc, LeaseRefused):
                self._miss.give_back(key, mine)
            return None
        except asyncio.CancelledError:
            # close() stopping us (nothing else cancels a refresh): kept, the lease made
            # every other instance's miss of the key wait max_wait, for lease_ttl.
            self._miss.give_back(key, mine)
            raise

    async def _refreshed_meanwhile(self, key: str, seen: Envelope[Any]) -> bool:
        """Double-check under the lease, as a miss does (``MissPath._filled_meanwhile``):
        the read that started us may have fetched the old value just before another
        refresh, here or in another process, wrote the new one and released the lease.
        Refreshing again would be a second recompute for one expiry (seen: a page read
        every 10 ms refreshed a book twice, 0.2 s apart). A write since (a refresh, a
        fill, a set()) has another ``written_at``; a key that is gone is refreshed."""
        current = self._fills.recheck(await self._rt.store.get(key))
        return current is not None and current.written_at != seen.written_at

    async def fresh_base(self, key: str) -> Envelope[Any] | None:
        """``get()`` of a hot key whose replica gave no fresh value: the base key's value
        if it is fresh (and alive), with the copy to the replicas started; else None.

        A replica can be there but unusable while the base is fresh: soft-expired after
        an instance where the key is not hot refilled only the base, or undecodable.
        ``get_or_load`` finds the base under the lease (``MissPath._filled_meanwhile``),
        which copies it too; ``get()`` takes no lease, so it reads the base here (only
        after a replica answered: a key not hot here, or a missing replica, was read
        from its base already)."""
        if not self._fills.is_hot(key):
            return None
        policy = self._policy
        try:
            envelope = self._fills.decode(key, await self._rt.store.get(key))
        except L2Unavailable:
            policy.stats.redis_error += 1
            return None
        if envelope is None or self._rt.clock() >= envelope.soft_expiry:
            return None
        if envelope.tags is not None and not await self._fills.versions.valid(envelope.tags):
            return None
        self.copy_to_replicas(key)
        return envelope

    def copy_to_replicas(self, key: str) -> None:
        """Start copying the base value of a key found hot with empty replicas."""
        if key in self._copying:
            return
        self._copying.add(key)
        self._rt.tasks.spawn(self._copy(key))

    async def _copy(self, key: str) -> None:
        policy = self._policy
        token = new_token()
        try:
            await replicas.copy_to_replicas(
                self._rt.store, self._rt.leases, key, policy.replicas, policy.lease_ttl, token
            )
        except L2Unavailable as exc:
            policy.stats.redis_error += 1
            if not isinstance(exc, LeaseRefused):
                # The lease may be ours (a late reply, a failed step after it): given
                # back, or every reader of the key would wait max_wait (the reservations
                # expire with it). A no-op once the copy's read released it.
                self._miss.give_back(key, token)
        except asyncio.CancelledError:
            # close() stopping us after the SET NX may have landed: the lease goes back,
            # as in ``_leased`` (a no-op once the copy's read released it).
            self._miss.give_back(key, token)
            raise
        finally:
            self._copying.discard(key)
