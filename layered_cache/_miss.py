"""What a miss does: take the fleet-wide lease and load, or wait for the holder's fill;
fill L2 (and L1) under the lease; fall back to a stale value if the loader fails.

Rules that keep a superseded value from outliving an invalidation:

- L2 is written only under the lease (compare-and-write), and an invalidation deletes
  the lease, so a fill whose load began before an invalidation can't land after it.
- L1 is filled only if the key wasn't invalidated since this request's L2 read began
  (``Read.seq``, the L1's invalidation sequence at that moment).
- The stale fallback re-reads L2 first: an invalidated or overwritten value is never
  served as a fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from layered_cache import _replicas as replicas
from layered_cache._clients import resurface_cancel
from layered_cache._failsafe import FailSafe, Read
from layered_cache._fills import Fills, FillWatch
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable, LeaseRefused
from layered_cache._loader_call import (
    LoaderCancelledError,
    RequestBound,
    awaited,
    call_loader,
    retrieve_outcome,
)
from layered_cache._loading import Loading
from layered_cache._policy import Policy
from layered_cache._runtime import Runtime
from layered_cache._stampede import bound_lease, new_token
from layered_cache._tags import TagsOf, tag_names

__all__ = [
    "LoaderCancelledError", "MissPath", "Read", "TagsOf", "awaited", "call_loader",
    "retrieve_outcome", "unstored", "warn_if_outlived",
]

Loader = Callable[[], Awaitable[Any]]

_log = structlog.get_logger("layered_cache")


class MissPath:
    def __init__(self, policy: Policy, fills: Fills, runtime: Runtime) -> None:
        self._policy = policy
        self._fills = fills
        self._rt = runtime
        self._loading = Loading(runtime.store, runtime.prefix, runtime.tasks.spawn)
        self.failsafe = FailSafe(policy, fills, runtime)
        # The namespace's ``Refresher.copy_to_replicas`` (built after this object).
        self.replicas_behind: Callable[[str], None] = _ignore

    async def load_under_lease(self, read: Read, loader: Loader) -> Any:
        """Win the lease and load, or wait for the winner's fill (``max_wait`` at most,
        then load without writing L2)."""
        policy, key = self._policy, read.key
        # Every SET NX of ours carries this token, known before it is sent: a cancel that
        # lands once one did (its reply still on the way) can give that lease back.
        mine = new_token()
        try:
            token = await self._rt.leases.try_acquire(lease_name(key), policy.lease_ttl, mine)
            if token is None:
                policy.stats.lease_lost += 1
                waited = await wait_or_stale(self, read, mine)
                if isinstance(waited, _Filled):
                    return waited.value
                # Closed while we waited (``LeaseWaiter.end_waits``): no loader call, and
                # a lease taken over meanwhile goes back (close() waits for it).
                if isinstance(waited, str) and self._rt.refusal is not None:
                    self.give_back(key, waited)
                self._rt.check_open()
                if waited is None:
                    # max_wait passed: load ourselves, but never write L2 without a lease.
                    policy.stats.lease_timeout_load += 1
                    self._rt.tasks.spawn(bound_lease(self._rt.store, key, policy.lease_ttl))
                    return await self.load_unleased(read, loader)
                token = waited
            filled = await self._filled_meanwhile(read, token)
            if filled is not None:
                return filled.value
        except L2Unavailable as exc:  # a late SET NX reply, a failed check: it may be ours
            policy.stats.redis_error += 1
            if not isinstance(exc, LeaseRefused):  # refused unsent: none to give back
                self.give_back(key, mine)
            return await self.load_unleased(read, loader)
        except asyncio.CancelledError:
            self.give_back(key, mine)
            raise
        policy.stats.lease_won += 1
        return await self.load_and_fill(read, token, loader)

    def give_back(self, key: str, token: str) -> None:
        """Release our lease (if ``token`` holds it) in the background, for a caller being
        cancelled (it can't await) or whose Redis step timed out: kept, every reader of the
        key, fleet-wide, waits ``max_wait``. A no-op where we never held it (compare-and-delete).
        An orphan: ``close()`` waits for it, also for one that a task it cancelled gives
        back (a refresh, a fill), which an ordinary task spawned then would outlive."""
        self._rt.tasks.spawn_orphan(self.release(key, token))

    async def _wait_for_fill(self, read: Read, token: str) -> _Filled | str | None:
        """The winner's fill, our own lease (the winner gave up), or None (timeout)."""
        policy, fills = self._policy, self._fills
        watch = FillWatch(fills, read.key, self._rt.clock)
        result = await self._rt.leases.wait_for_fill(
            read.key, lease_name(read.key), policy.lease_ttl, policy.reread_pause,
            policy.max_wait, watch.usable, token,
        )
        if result.data is None:
            return result.token
        envelope = watch.accepted
        assert envelope is not None  # ``usable`` accepted it
        if envelope.tags is not None and not await fills.versions.valid(envelope.tags):
            return None  # its tag died while we waited: load without writing L2
        policy.stats.lease_wait_filled += 1
        fills.fill_l1(read.key, envelope.value, envelope.soft_expiry, read.seq, envelope.tags)
        return _Filled(envelope.value)

    async def _filled_meanwhile(self, read: Read, token: str) -> _Filled | None:
        """Double-check under the lease: the previous winner's fill script releases the
        lease as it writes, so a fill can land between our miss and our SET NX. Loading
        now would be a second load for the same expiry."""
        filled = self._fills.recheck(await self._rt.store.get(read.key))
        if filled is None or self._rt.clock() >= filled.soft_expiry:
            return None
        if filled.tags is not None and not await self._fills.versions.valid(filled.tags):
            return None
        await self.release(read.key, token)
        self._policy.stats.lease_wait_filled += 1
        self._fills.fill_l1(read.key, filled.value, filled.soft_expiry, read.seq, filled.tags)
        if self._fills.is_hot(read.key):
            # Our read found the replica expired and the base fresh: an instance where
            # the key is not hot refilled only the base. Left so, every read here would
            # take this path (a lease and a second GET on the base key's master) until
            # the replicas expire; copied, they serve again.
            self.replicas_behind(read.key)
        return _Filled(filled.value)

    async def load_and_fill(
        self, read: Read, token: str, loader: Loader, *, refresh: bool = False
    ) -> Any:
        """Load under our lease, then fill. A slow loader with a stale value at hand
        serves stale after ``load_timeout`` and fills in the background. ``refresh``: an
        XFetch refresh, which no caller awaits (``_load_cancelled``)."""
        policy = self._policy
        try:
            registered = not policy.tags or await self._register(read, token)
        except asyncio.CancelledError:  # ``Loading.enter`` took its member out again
            self.give_back(read.key, token)
            raise
        if not registered:
            return await self.load_unleased(read, loader)
        started = time.monotonic()
        task: asyncio.Task[Any] = asyncio.ensure_future(
            call_loader(self._policy, self._rt.hooks, loader)
        )
        # Runs on if our caller is cancelled (it holds the lease; shield below): nobody
        # awaits it then, and its failure (counted) must not surface as never retrieved.
        task.add_done_callback(retrieve_outcome)
        try:
            bound = isinstance(loader, RequestBound)  # no stale answer: see RequestBound
            if read.stale is not None and policy.load_timeout is not None and not bound:
                done, _ = await asyncio.wait({task}, timeout=policy.load_timeout)
                if not done and await self.failsafe.usable(read):
                    policy.stats.stale_served += 1
                    _log.warning("load_timeout_serving_stale", namespace=policy.name, key=read.key)
                    self._rt.tasks.spawn(_finish_fill(self, read, token, task, started))
                    return read.stale.value
            value = await asyncio.shield(task)
        except asyncio.CancelledError:
            _load_cancelled(self, read, token, task, started, refresh)
            raise
        except BaseException as exc:  # nobody will fill: the lease goes back
            # Released before our caller hears of it; a cancel now leaves the release going.
            self._unregister(read, token)  # first: a cancel in the release skips what follows
            await self._rt.tasks.to_completion(self.release(read.key, token))
            if not isinstance(exc, Exception):
                raise  # not an error to serve stale for (GreenletExit, an app's abort)
            return await self.failsafe.serve_or_raise(read, exc)
        elapsed = time.monotonic() - started  # to completion: a cancel here made joiners reload
        return await self._rt.tasks.to_completion(self.fill(read, token, value, elapsed))

    async def _register(self, read: Read, token: str) -> bool:
        """A tagged load joins the set ``invalidate_tag`` revokes, before it starts
        (``_tags``). Redis failing here: load without writing L2."""
        try:
            await self._loading.enter([lease_name(read.key)], token)
        except L2Unavailable:
            self._policy.stats.redis_error += 1
            await self.release(read.key, token)
            return False
        return True

    def _unregister(self, read: Read, token: str) -> None:
        if self._policy.tags:
            self._loading.leave([lease_name(read.key)], token)

    async def load_l1_only(self, read: Read, loader: Loader) -> Any:
        """The miss of an ``l2 = false`` namespace: load, then fill L1."""
        generation = self._fills.versions.generation
        value = await self.load_unleased(read, loader)
        await self._fills.fill_l1_only([(read.key, read.seq, value)], read.tags_of, generation)
        return value

    async def load_unleased(self, read: Read, loader: Loader) -> Any:
        """Load without writing L2 (no lease, or Redis unavailable): kept in L1 though."""
        try:
            value = await call_loader(self._policy, self._rt.hooks, loader)
        except Exception as exc:
            return await self.failsafe.serve_or_raise(read, exc)
        if not self._policy.l2:
            return value  # no L2 layer: the loader's object is what every layer returns
        return self.kept_in_l1(read, value)

    def kept_in_l1(self, read: Read, value: Any) -> Any:
        """``value`` as an L2 hit returns it, not in L2 (``Fills.kept_in_l1``)."""
        if self._rt.ended:
            return unstored(read, value)  # a closed cache keeps no L1 (``close``)
        served = self._fills.kept_in_l1(read.key, value, read.seq, read.tags_of is not None)
        read.owned = served is value  # not encodable: handed back as it came
        return served

    async def fill(self, read: Read, token: str, value: Any, delta: float) -> Any:
        """Write L2 under the lease (base, then replicas for a hot key), then L1.
        Returns the value as L2 readers will see it (see ``Fills.encode``). Any
        error releases the lease: other readers must not wait max_wait for nothing."""
        warn_if_outlived(self._policy, [read.key], delta)
        if self._rt.ended:
            return unstored(read, value)  # closed while loading: ``unstored``
        try:
            return await self._fill_under_lease(read, token, value, delta)
        except asyncio.CancelledError:
            self.give_back(read.key, token)  # the fill may or may not have landed
            raise
        except Exception:
            await self.release(read.key, token, quietly=False)
            raise
        finally:
            self._unregister(read, token)

    async def _fill_under_lease(self, read: Read, token: str, value: Any, delta: float) -> Any:
        policy, fills, key = self._policy, self._fills, read.key
        soft_expiry = policy.soft_expiry(value, self._rt.clock())
        versions = None
        if read.tags_of is not None:
            try:  # read after the load: see ``_tags`` for why that is safe
                versions = await fills.versions.current(tag_names(read.tags_of, value))
            except L2Unavailable:
                policy.stats.redis_error += 1
                await self.release(key, token, quietly=False)
                return self.kept_in_l1(read, value)  # tagged: not kept
        encoded = fills.encode(key, value, soft_expiry, delta, versions)
        read.owned = encoded.value is value  # not encodable: handed back as it came
        value, data = encoded.value, encoded.data
        if data is None:
            await self.release(key, token)
            return value
        hot = replicas.replica_leases(key, policy.replicas) if fills.is_hot(key) else []
        try:
            written = await replicas.fill(
                self._rt.store,
                key,
                token,
                data,
                fills.redis_ttl_ms(soft_expiry),
                hot,
                replicas.reserve_ms(policy.lease_ttl),
            )
        except L2Unavailable:
            policy.stats.redis_error += 1
            await self.release(key, token, quietly=False)
            return value
        if not written:
            policy.stats.fill_revoked += 1
            read.revoked = True  # the caller still gets it; ``Served`` tells the HTTP layer
            return value
        fills.fill_l1(key, value, soft_expiry, read.seq, versions, loaded=True)
        return value

    async def release(self, key: str, token: str, *, quietly: bool = True) -> None:
        """Give our lease back, past an open breaker too (``_giveback``). ``quietly``: only
        Redis failures are ignored; else any error (a failed fill's lease must not stay)."""
        caught: type[Exception] = L2Unavailable if quietly else Exception
        with contextlib.suppress(caught):
            await self._rt.give_backs.release(lease_name(key), token)


@dataclass(frozen=True, slots=True)
class _Filled:
    """Another request's fill (or one that landed meanwhile) answered ours."""

    value: Any


async def wait_or_stale(miss: MissPath, read: Read, token: str) -> _Filled | str | None:
    """``MissPath._wait_for_fill``, but with a stale value at hand and ``load_timeout``
    set, at most ``load_timeout``: then the stale value, as the winner's own caller got
    it (another reader of the key waited for the whole slow load)."""
    policy = miss._policy
    if read.stale is None or policy.load_timeout is None:
        return await miss._wait_for_fill(read, token)
    waiting = asyncio.ensure_future(miss._wait_for_fill(read, token))
    caller = asyncio.current_task()
    requested = caller.cancelling() if caller is not None else 0
    try:
        done, _ = await asyncio.wait({waiting}, timeout=policy.load_timeout)
        if not done and await miss.failsafe.usable(read) and not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            miss.give_back(read.key, token)  # if the wait had just taken the lease over
            # A cancel of our caller that arrived meanwhile went to ``waiting`` (the task
            # we awaited), and the suppress above ate it: raise it here.
            resurface_cancel(caller, requested)
            policy.stats.stale_served += 1
            _log.warning("load_timeout_serving_stale", namespace=policy.name, key=read.key)
            assert read.stale is not None
            return _Filled(read.stale.value)
        return await waiting
    except asyncio.CancelledError:
        waiting.cancel()  # asyncio.wait leaves it running
        raise


def _load_cancelled(
    miss: MissPath, read: Read, token: str, task: asyncio.Task[Any], started: float, refresh: bool
) -> None:
    """``MissPath.load_and_fill`` cancelled while its load runs.

    A caller that went away (a client's deadline): the load runs on and fills L2 (and
    releases the lease) in the background, so the readers waiting on it, here (the
    single-flight joiners start over and wait on the lease) and in other processes, get
    its value instead of loading again after ``max_wait``.

    A refresh has no caller: only ``close()`` cancels it, and its load ends with it.
    Running on, it filled L2 after close() returned, on a connection nobody closed. No
    reader loses a value by it: none joins a
    refresh's load (it runs outside the single-flight), readers that miss the key wait
    on its lease, which goes back once the load has ended (a waiter then takes it
    over). That end, and the release, are an orphan: close() waits for it."""
    finishing = _finish_fill(miss, read, token, task, started)
    if refresh:
        task.cancel()
    (miss._rt.tasks.spawn_orphan if refresh else miss._rt.tasks.spawn)(finishing)


async def _finish_fill(
    miss: MissPath, read: Read, token: str, task: asyncio.Task[Any], started: float
) -> None:
    """The fill of a load whose caller left or was served stale after ``load_timeout``."""
    try:
        value = await task
    except BaseException as exc:
        # A failed load (whatever it raised), or a cancelled one (a loader that raised
        # CancelledError, a refresh or close() stopping us): nobody will fill, the lease
        # goes back.
        await miss.release(read.key, token)
        miss._unregister(read, token)
        current = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and current and current.cancelling():
            raise
        return
    # The request's read.seq: an invalidation delivered while this slow load ran (or
    # between its L2 write and here) must keep it out of L1.
    await miss.fill(read, token, value, time.monotonic() - started)


def warn_if_outlived(policy: Policy, keys: Sequence[str], load_s: float) -> None:
    """A load longer than ``lease_ttl`` lost its lease: its fill is refused (``fill_revoked``),
    a waiter loads again, the key may never be cached. Said, with the fix (a batch's: once)."""
    if keys and load_s > policy.lease_ttl:
        _log.warning(
            "load_outlived_lease", namespace=policy.name, key=keys[0], keys=len(keys),
            load_s=round(load_s, 3), lease_ttl_s=policy.lease_ttl,
            fix="raise stampede.lease_ttl above the slowest load",
        )


def unstored(read: Read, value: Any) -> Any:
    """The load of a call in flight when its cache closed: its caller gets it, stored
    nowhere. Filled, it reopened the closed client on a connection nobody closed, and
    wrote L1 after close() had dropped it, unheard by any listener."""
    read.owned = True
    return value


def _ignore(key: str) -> None:
    """``MissPath.replicas_behind`` before the namespace wires it."""
