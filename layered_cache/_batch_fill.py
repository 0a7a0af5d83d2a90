"""The won keys of a batch: the fills that landed before our leases, the load (one
``load_many`` call) and the fill of its values under their leases (one pipeline per
master), the leases given back where nothing will fill. ``MissPath`` does the same for
one key, and so does this: a slow load with a stale value at hand for every key serves
them after ``load_timeout`` and fills in the background (``load_and_fill``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog

from layered_cache._codec import Envelope
from layered_cache._failsafe import Read
from layered_cache._fills import Fills
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable
from layered_cache._l2batch import Fill, L2Batch, Replies
from layered_cache._loading import Loading
from layered_cache._miss import MissPath, retrieve_outcome, unstored, warn_if_outlived
from layered_cache._policy import Policy
from layered_cache._runtime import Runtime
from layered_cache._tags import tag_names

__all__ = ["BatchFill", "versions_of"]

_log = structlog.get_logger("layered_cache")


class BatchFill:
    def __init__(
        self, policy: Policy, fills: Fills, miss: MissPath, runtime: Runtime, batch: L2Batch
    ) -> None:
        self._policy = policy
        self._fills = fills
        self._miss = miss
        self._rt = runtime
        self._batch = batch
        self._loading = Loading(runtime.store, runtime.prefix, runtime.tasks.spawn)

    async def enter(self, reads: list[Read], token: str) -> bool:
        """A tagged batch's won keys join the loading set before their load (``_tags``).
        False: Redis failed, the leases went back (load without writing L2)."""
        if not self._policy.tags:
            return True
        try:
            await self._loading.enter([lease_name(r.key) for r in reads], token)
        except L2Unavailable:
            self._policy.stats.redis_error += 1
            await self.release([r.key for r in reads], token)
            return False
        return True

    def _leave(self, reads: list[Read], token: str) -> None:
        if self._policy.tags and not self._rt.ended:  # closed: no Redis after close()
            self._loading.leave([lease_name(r.key) for r in reads], token)

    async def load_and_fill(
        self, reads: list[Read], token: str, load: Coroutine[Any, Any, Sequence[Any]]
    ) -> dict[str, Any]:
        """Run ``load`` (of every key of ``reads``, under our leases), then fill. With a
        stale value at hand for every key, a load slower than ``load_timeout`` serves
        them and fills in the background (``MissPath.load_and_fill``)."""
        started = time.monotonic()
        task: asyncio.Task[Sequence[Any]] = asyncio.ensure_future(load)
        # After stale was served only ``_finish`` awaits the load, and close() may cancel
        # it first: a failure (counted in load_error already) must not surface as "Task
        # exception was never retrieved".
        task.add_done_callback(retrieve_outcome)
        try:
            if await self._timed_out(reads, task):
                # Tracked by the runtime: close() waits a moment for it, then cancels it,
                # and a cancelled fill gives its leases back (``_finish``).
                self._rt.tasks.spawn(self._finish(reads, token, task, started))
                for read in reads:  # their leases are the fill's now, not our caller's
                    read.handed_over = True
                return {read.key: read.stale.value for read in reads if read.stale is not None}
            values = await task
        except asyncio.CancelledError:
            # Unlike a single key's, a batch's load ends with its caller: awaiting the
            # task cancels it with us, ``asyncio.wait`` in ``_timed_out`` doesn't, hence
            # the cancel. The caller gives every won lease back (``_load_misses``).
            task.cancel()
            self._leave(reads, token)
            raise
        except BaseException as exc:  # nobody will fill: the leases go back
            task.cancel()  # if ``_timed_out`` failed, not the load: it must not run on
            await self.release([r.key for r in reads], token)
            self._leave(reads, token)
            if not isinstance(exc, Exception):
                raise  # not an error to serve stale for (GreenletExit, an app's abort)
            return await self._miss.failsafe.serve_all_or_raise(reads, exc)
        return await self._fill_loaded(reads, token, values, started)

    async def _timed_out(self, reads: list[Read], task: asyncio.Task[Sequence[Any]]) -> bool:
        """Whether ``load_timeout`` passed before the load ended and every key's stale
        value may be served (``FailSafe.usable``: not invalidated or overwritten since
        the read). A batch returns all its values at once, so serving some stale would
        still wait for the load: all or none."""
        policy = self._policy
        if policy.load_timeout is None or any(read.stale is None for read in reads):
            return False
        done, _ = await asyncio.wait({task}, timeout=policy.load_timeout)
        if done:
            return False
        usable = await asyncio.gather(*(self._miss.failsafe.usable(read) for read in reads))
        if not all(usable):
            return False  # the load is awaited, as for a single key
        policy.stats.stale_served += len(reads)
        _log.warning("load_timeout_serving_stale", namespace=policy.name, keys=len(reads))
        return True

    async def _finish(
        self, reads: list[Read], token: str, task: asyncio.Task[Sequence[Any]], started: float
    ) -> None:
        """The fill of a load whose caller was served stale (``_miss._finish_fill``)."""
        try:
            values = await task
        except BaseException as exc:
            # A failed load (whatever it raised), or a cancelled one (a loader that raised
            # CancelledError, or close() stopping us): nobody will fill, the leases go back.
            await self.release([r.key for r in reads], token)
            self._leave(reads, token)
            current = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and current and current.cancelling():
                raise
            return
        # Each read's seq is the request's: an invalidation delivered while this slow
        # load ran (or between its L2 write and its L1 fill) keeps it out of L1, and one
        # that deleted a lease meanwhile refuses its fill (``fill_many``).
        await self._fill_loaded(reads, token, values, started)

    async def _fill_loaded(
        self, reads: list[Read], token: str, values: Sequence[Any], started: float
    ) -> dict[str, Any]:
        # Each entry's recompute time for XFetch (with 0 none was refreshed early).
        delta = time.monotonic() - started
        try:
            found = await self.fill_many(reads, values, token, delta)
        except asyncio.CancelledError:
            # Our caller's deadline, or close() stopping a background fill: the leases go
            # back without our waiting for it (a cancelled caller can't; close() waits
            # for orphans once more after its cancels). Compare-and-delete: a no-op
            # where the fill landed and released them.
            self._rt.tasks.spawn_orphan(self.release([r.key for r in reads], token))
            raise
        except Exception:
            # Not Redis (``fill_many`` handles that): a tag function that raised or a bad
            # tag. The leases go back, as ``MissPath.fill`` does, or every reader of these
            # keys would wait ``max_wait`` for fills that never land.
            await self.release([r.key for r in reads], token)
            raise
        finally:
            self._leave(reads, token)
        # A batch's leases run through its load and its tag versions' round trips too.
        revoked = [read.key for read in reads if read.revoked]
        warn_if_outlived(self._policy, revoked, time.monotonic() - started)
        return found

    async def filled_meanwhile(self, reads: list[Read], token: str) -> dict[str, Any]:
        """Fills that landed between our MGET and our SET NX (``MissPath._filled_meanwhile``)."""
        try:
            # A key whose master failed reads as None: not filled, loaded under its lease.
            data = (await self._batch.get_many([r.key for r in reads])).values
        except L2Unavailable:
            return {}
        now = self._rt.clock()
        filled: list[tuple[Read, Envelope[Any]]] = []
        for read, value in zip(reads, data, strict=True):
            envelope = self._fills.recheck(value)
            if envelope is not None and now < envelope.soft_expiry:
                filled.append((read, envelope))
        # A tagged copy counts only if its tags are current, judged as the MGET judged
        # it (``BatchReader._alive``): the copy found here may be the very one the MGET
        # refused as dead, not a fill that landed since.
        tagged = [(read, envelope) for read, envelope in filled if envelope.tags is not None]
        try:
            verdicts = await self._fills.versions.valid_many([e.tags or {} for _, e in tagged])
        except L2Unavailable:
            verdicts = [False] * len(tagged)
        dead = {read.key for (read, _), valid in zip(tagged, verdicts, strict=True) if not valid}
        found: dict[str, Any] = {}
        for read, envelope in filled:
            if read.key in dead:
                continue
            self._policy.stats.lease_wait_filled += 1
            self._fills.fill_l1(
                read.key, envelope.value, envelope.soft_expiry, read.seq, envelope.tags
            )
            found[read.key] = envelope.value
        await self.release(list(found), token)
        return found

    async def fill_many(
        self, reads: list[Read], values: Sequence[Any], token: str, delta: float
    ) -> dict[str, Any]:
        """Each value under its lease, in one pipeline (hot keys: ``_replicas``); L1 then.
        Closed while it loaded: handed back, stored nowhere (``MissPath.fill``)."""
        if self._rt.ended:
            return {r.key: unstored(r, v) for r, v in zip(reads, values, strict=True)}
        policy, fills = self._policy, self._fills
        found: dict[str, Any] = {}
        batch: list[tuple[Read, Fill, Any, float, dict[str, str] | None]] = []
        hot: list[tuple[Read, Any]] = []
        uncacheable: list[str] = []  # not encodable or too large: served, not stored
        try:
            versions = await versions_of(self._fills, reads, values)
        except L2Unavailable:  # no version, no fill: the values are served, not stored
            policy.stats.redis_error += 1
            await self.release([r.key for r in reads], token)
            return {r.key: self._miss.kept_in_l1(r, v) for r, v in zip(reads, values, strict=True)}
        for read, value, tagged in zip(reads, values, versions, strict=True):
            if fills.is_hot(read.key):
                hot.append((read, value))
                continue
            soft_expiry = policy.soft_expiry(value, self._rt.clock())
            encoded = fills.encode(read.key, value, soft_expiry, delta, tagged)
            found[read.key] = encoded.value
            read.owned = encoded.value is value  # not encodable: handed back as it came
            if encoded.data is None:
                uncacheable.append(read.key)
                continue
            data = encoded.data
            fill = (read.key, lease_name(read.key), data, fills.redis_ttl_ms(soft_expiry))
            batch.append((read, fill, found[read.key], soft_expiry, tagged))
        await self.release(uncacheable, token)
        written = await self._write(token, [b[1] for b in batch])
        for (read, _, value, soft_expiry, tagged), done in zip(batch, written, strict=True):
            if done:
                fills.fill_l1(read.key, value, soft_expiry, read.seq, tagged, loaded=True)
            else:
                policy.stats.fill_revoked += 1
                read.revoked = True  # served, but no gateway may keep it (``Served``)
        # Hot keys fill one by one through the replica protocol (reserve, check, write
        # replicas): rare, and each spans several slots.
        filled = await asyncio.gather(*(self._miss.fill(r, token, v, delta) for r, v in hot))
        found.update((read.key, result) for (read, _), result in zip(hot, filled, strict=True))
        return found

    async def _write(self, token: str, fills: list[Fill]) -> list[bool]:
        """``fill_many``: which ones were written. A failed master's (all of them: Redis
        failed) are not, and their leases go back: the fill may not have run."""
        try:
            replies = await self._batch.fill_many(fills, token)
        except L2Unavailable:
            replies = Replies([False] * len(fills), frozenset(range(len(fills))))
        if replies.failed:
            self._policy.stats.redis_error += 1
            await self.release([fills[i][0] for i in sorted(replies.failed)], token)
        return replies.values

    def give_back(self, reads: list[Read], token: str) -> None:
        """``release`` in the background, for a cancelled batch or a failed lease round
        trip (``MissPath.give_back``)."""
        if reads:
            self._rt.tasks.spawn(self.release([r.key for r in reads], token))

    async def release(self, keys: list[str], token: str) -> None:
        # Those an open breaker refused go past it (``_giveback``); a failed master's
        # expire by themselves (lease_ttl).
        refused = await self._batch.release_many([lease_name(key) for key in keys], token)
        if refused:
            self._rt.give_backs.past_breaker(refused, token)


async def versions_of(
    fills: Fills, reads: list[Read], values: Sequence[Any]
) -> list[dict[str, str] | None]:
    """Each loaded value's ``{tag: version}`` (versions of all of them fetched in one
    round trip), or None per value when the batch has no tags."""
    tags_of = reads[0].tags_of if reads else None
    if tags_of is None:
        return [None] * len(reads)
    names = [tag_names(tags_of, value) for value in values]
    current = await fills.versions.current(t for tags in names for t in tags)
    return [{tag: current[tag] for tag in tags} for tags in names]
