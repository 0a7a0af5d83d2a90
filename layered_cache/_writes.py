"""``set`` and ``set_many`` of one namespace: unconditional writes of new values.

A write revokes every fill in flight first (it may carry an older value): the base
lease, then each replica lease (``_replicas.set_plan``), in the same pipeline as the
SETs. Then the keys are announced on the backplane, so other instances drop their L1
copies, and only then does this instance's L1 take the new value. ``set_many`` is the
same for many keys: one round trip (one atomic step on a single node:
``_write_commands``), one backplane append.

In a cluster the L2 write runs to completion even if its caller is cancelled, as an
invalidation does: a hot key's write is three round trips there (the replica
reservations, the base keys, then the replicas: ``replicas.write_many``), and a caller
cancelled between them left every replica older than the base for the whole L2 TTL.
On one node it is one atomic step (all or nothing), awaited in place: no task (a
set()'s cost is a benchmark target, bench/sets.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from layered_cache import _replicas as replicas
from layered_cache._backplane import Announcement
from layered_cache._fills import Fills
from layered_cache._l2 import BreakerOpen, L2Unavailable, Write
from layered_cache._memory_policy import refused_for_memory
from layered_cache._policy import Policy
from layered_cache._readyqueue import others_are_ready
from layered_cache._runtime import Runtime
from layered_cache._tags import entry_tags
from layered_cache._write_commands import Append
from layered_cache._write_ends import WriteEnds

__all__ = ["Writes"]


class _Write:
    """One ``set()``'s L2 write, as its caller and the task writing it both see it: the
    caller may be cancelled while the write runs on (``Writes._write``)."""

    __slots__ = (
        "announcement",
        "appended",
        "done",
        "keys",
        "left",
        "phased",
        "refused",
        "unsent",
    )

    def __init__(self, keys: list[str], announcement: Announcement | None) -> None:
        self.keys = keys
        self.announcement = announcement  # rides in the write's atomic step (one node)
        self.appended: bool | None = None  # whether the write carried it (None: no reply)
        self.done = False  # the write's task finished (landed or failed)
        self.left = False  # its caller was cancelled: whoever is last finishes the set()
        self.refused = False  # a full Redis refused part of it: the keys must be dropped
        self.unsent = False  # an open breaker refused it before sending: it can't land
        self.phased = False  # a cluster set() of hot keys began its phases (``_replicas``)

    def began_phases(self) -> None:
        self.phased = True

    def unannounced(self) -> bool:
        """Whether the keys still need announcing: no announcement rode in the write (a
        cluster, no backplane), or the stream refused it and nothing else carried it.
        With no reply read (its caller left, it timed out: it may land later), the write
        needs nothing more: its append appends, or publishes on the fallback channel,
        with its SETs, or runs not at all (``_write_commands``). Announced now, in the
        background, it could come before the write lands, and a read here in between
        would keep the replaced value (``_unsettled`` waits for the write's own)."""
        return self.announcement is None or self.appended is False


class Writes:
    def __init__(
        self,
        policy: Policy,
        fills: Fills,
        runtime: Runtime,
        forget: Callable[[list[str]], object],
    ) -> None:
        self._policy = policy
        self._fills = fills
        self._rt = runtime
        self._forget = forget
        self._ends = WriteEnds(policy, runtime, forget)

    async def set_many(
        self,
        items: Sequence[tuple[Mapping[str, object], Any]],
        tags: Iterable[str] | None = None,
    ) -> None:
        """Raises ``L2Unavailable`` if Redis fails, including when the values were
        written but neither the backplane append nor its pub/sub fallback (``_fallback``)
        was taken: then other instances may still serve their old L1 copies for their
        TTL, and returning normally would promise otherwise (a failed write is announced
        in the background). A Redis full under noeviction refuses the values: the keys
        are dropped everywhere instead."""
        self._rt.check_open()
        if not isinstance(items, list):
            items = list(items)  # read once: written, then purged (an iterator is taken)
        async with self._rt.admission:  # see Runtime.admission
            # Once more to the back of the loop's queue: in a burst, every other call
            # parks at the admission first, so the timeouts of our Redis round trips
            # (connect, read) start on a loop that is free to serve them.
            if others_are_ready():  # a burst: see _readyqueue
                await asyncio.sleep(0)
            try:
                await self._set_many(items, tags)
            finally:
                # Also when the write failed or our caller was cancelled: it may have
                # landed, and a needless purge costs the gateway one miss.
                self._purge(items)

    def _purge(self, items: Sequence[tuple[Mapping[str, object], Any]]) -> None:
        """HTTP caches drop their copies (background; key names built only with a purger)."""
        if not self._rt.purges.active:
            return
        try:
            keys = [self._policy.template.build(fields) for fields, _ in items]
        except (KeyError, TypeError, ValueError):
            return  # a bad key: refused before anything was written
        self._rt.purges.submit(keys)

    async def _set_many(
        self, items: Sequence[tuple[Mapping[str, object], Any]], tags: Iterable[str] | None
    ) -> None:
        policy, fills = self._policy, self._fills
        versions = await fills.versions.current(entry_tags(tags)) if tags is not None else None
        # A key given twice keeps its last value, as set() calls in that order would:
        # the last one also decides whether the key is written or dropped.
        last = {policy.template.build(fields): value for fields, value in items}
        keyed = list(last.items())
        if not policy.cache or not keyed:
            return
        policy.stats.set += len(keyed)
        read_seq, held = self._begin([key for key, _ in keyed])
        if not policy.l2:
            # Each instance's L1 is all there is: the others must drop their copies, as
            # for invalidate() (they kept the old value for their L1 TTL).
            await self._ends.announce_or_abandon([key for key, _ in keyed])
            for key, value in keyed:
                fills.fill_l1(key, value, None, read_seq, versions, loaded=True)
            return
        writes: list[Write] = []
        settled: list[tuple[str, Any, float]] = []
        uncacheable: list[str] = []
        now = self._rt.clock()  # one write, one time: its values are stamped alike
        for key, value in keyed:
            soft_expiry = policy.soft_expiry(value, now)
            encoded = fills.encode(key, value, soft_expiry, 0.0, versions, now)
            if encoded.data is None:
                uncacheable.append(key)
                continue
            names, outdated = replicas.set_plan(key, policy.replicas, fills.is_hot(key))
            writes.append((names, outdated, encoded.data, fills.redis_ttl_ms(soft_expiry, now)))
            settled.append((key, encoded.value, soft_expiry))
        if uncacheable:
            # The new value can't be stored (not encodable, too large): the old one
            # must not be served in its place, so the key goes, everywhere (as
            # memcached drops a key whose new value is refused).
            await self._ends.drop(uncacheable)
        if not writes:
            return
        keys = [key for key, _, _ in settled]
        if not await self._write(writes, keys):
            return
        self._settle(settled, read_seq, versions, held)

    async def _write(self, writes: list[Write], keys: list[str]) -> bool:
        """Write L2, then announce ``keys``. On a single node the backplane append rides
        in the SETs' atomic step (one round trip instead of two, and it still lands after
        them); in a cluster (the stream's slot is not the keys') or when the stream
        refused it (the SETs landed), ``WriteEnds.announce`` follows, falling back to pub/sub.
        Returns False when a Redis full under noeviction refused the values: then the
        keys are dropped everywhere instead."""
        announcement = self._rt.invalidator.announcement_with_writes(keys)
        write = _Write(keys, announcement)
        try:
            # In a cluster to completion; on one node in place (the module doc says why).
            writing = self._written(writes, write)
            cluster = self._rt.store.cluster
            appended = await (self._rt.tasks.to_completion(writing) if cluster else writing)
        except asyncio.CancelledError:
            write.left = True
            if write.done and write.refused:  # refused, then cancelled before we resumed
                self._forget(keys)
                self._rt.tasks.spawn_orphan(self._ends.drop(keys))  # as below, in the background
            elif write.done:  # it finished before the cancel reached us: ours to do
                self._left(write)
            else:  # it ends on its own (``_written``); our L1 is dropped now already
                self._forget(keys)
            raise
        except L2Unavailable as exc:
            if not refused_for_memory(exc):
                # It may have landed (in a cluster in part): announced unless it rode in
                # the atomic step, else instances that heard nothing keep their copies.
                self._left(write)
                raise
            # Redis is full (noeviction) and refuses the new values, but still deletes:
            # as for a value that can't be stored, the old one goes, everywhere.
            self._policy.stats.not_cached += len(keys)
            self._policy.stats.refused_full += len(keys)
            await self._ends.drop(keys)
            return False
        if announcement is None or not appended:
            await self._ends.announce_or_abandon(keys)
        return True

    async def _written(self, writes: list[Write], write: _Write) -> bool:
        """``replicas.write_many``; our caller cancelled meanwhile, what it would have
        done after it, once the write is done: announce (not before: others could refill
        L1 from a replica not rewritten yet), drop our L1 again, purge HTTP caches again
        (``set_many``'s purge left before the write landed)."""
        try:
            store, lease_ttl = self._rt.store, self._policy.lease_ttl
            appended = await replicas.write_many(
                store, writes, write.announcement, lease_ttl, write.began_phases
            )
            if appended is Append.PUBLISHED:  # by the write's own script
                self._rt.invalidator.published_by_write(write.keys)
            write.appended = appended is not Append.REFUSED
            return write.appended
        except L2Unavailable as exc:
            write.refused = refused_for_memory(exc)
            write.unsent = isinstance(exc, BreakerOpen)
            if write.phased and not write.refused:
                # Some bases may hold the new value while replicas on a master that
                # failed keep the replaced one, their leases held by our reservation (no
                # copy replaces them) for the L2 TTL: announcing alone left them. Dropped
                # everywhere instead, retried in the background (a stalled master refuses
                # the DELs too); a full Redis's refusal is dropped below or by our caller.
                self._ends.drop_later(write.keys)
            if write.left and write.refused:
                # Full by the replicas, after the bases landed: drop the keys everywhere,
                # as our caller does on this error (announcing alone left old replicas).
                write.done = True
                self._policy.stats.refused_full += len(write.keys)
                await self._ends.drop(write.keys)
            raise
        finally:
            write.done = True
            if write.left:
                self._forget(write.keys)
                if write.unannounced():
                    await self._ends.announce_quietly(write.keys)
                self._rt.purges.submit(write.keys)  # a no-op without gateways

    def _left(self, write: _Write) -> None:
        """Our caller left once the write was done (cancelled, or it failed: a timeout).
        With no reply read, a single node's step may land later still, and with it its
        entry, which our listener skips as our own: noted (``_unsettled``), so that it
        drops what a read here filled meanwhile (not one an open breaker refused: it
        sent nothing, and a timeout storm would fill the record). Then
        ``WriteEnds.abandoned``."""
        if write.announcement is not None and write.appended is None and not write.unsent:
            self._rt.unsettled.add(write.keys)
        self._ends.abandoned(write.keys, announce=write.unannounced())

    def _begin(self, keys: list[str]) -> tuple[int | None, frozenset[str]]:
        """Detach in-flight loads and drop our L1 copies before writing. Like every other
        L1 fill: a remote set()/invalidate() of a key that reaches us (backplane) while
        our write is in flight tombstones it, and then our value is superseded and must
        not sit in L1 for its TTL - hence the read sequence taken here. Also the keys L1
        held: they take their place again when the write lands, even in an L1 filled
        meanwhile (writes don't allocate, but one of a key L1 held is no allocation)."""
        for key in keys:
            self._rt.flight.forget(key)
        l1 = self._policy.l1
        if l1 is None:  # a read here that this write overtook is told all the same
            self._policy.marks.discard(keys)  # (tombstones alone: ``_served``)
            return None, frozenset()
        held: list[str] = []
        l1.discard(keys, held)
        return l1.begin_read(), frozenset(held)

    def _settle(
        self,
        settled: list[tuple[str, Any, float]],
        read_seq: int | None,
        versions: dict[str, str] | None,
        held: frozenset[str] = frozenset(),
    ) -> None:
        """After our write landed: a load of these keys that began while it was in
        flight may have read the values we replaced. Detach it (later callers must not
        join it) and tombstone the keys again (its L1 fill is refused), then fill L1
        with our values - except a key another write ran for since we began: a set() of
        it here (its ``_begin`` or ``_settle`` tombstones it), a local invalidate(), or
        a remote one heard on the backplane. We can't tell whose L2 write landed last,
        so an overtaken set() leaves L1 empty (the next read refills from L2) rather
        than risk keeping a value L2 no longer holds. Of two overlapping set() calls,
        the one that began first is always overtaken (the other's ``_begin``
        tombstoned the key): when it settles it drops L1, whether or not the other
        filled it already (tests/test_set_race.py). No await in here: nothing can run
        between the checks and the fills, so the keys are dropped and filled in one go
        each (``Fills.settle_l1``: one lock, one clock reading) rather than one at a time."""
        flight = self._rt.flight
        for key, _, _ in settled:
            flight.forget(key)
        if read_seq is not None:  # None: no L1
            self._fills.settle_l1(settled, read_seq, versions, held)
        else:  # no L1: tombstones alone, as in ``_begin``
            self._policy.marks.discard([key for key, _, _ in settled])
