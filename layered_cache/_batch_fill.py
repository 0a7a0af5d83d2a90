"""The won keys of a batch, after their load: the fills that landed before our leases,
the fill of the loaded values under their leases (one pipeline per master), and the
leases given back where nothing will fill. ``MissPath`` does the same for one key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from layered_cache._codec import Envelope
from layered_cache._failsafe import Read
from layered_cache._fills import Fills
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable
from layered_cache._l2batch import Fill, L2Batch, Replies
from layered_cache._miss import MissPath
from layered_cache._policy import Policy
from layered_cache._runtime import Runtime
from layered_cache._tags import tag_names

__all__ = ["BatchFill", "versions_of"]


class BatchFill:
    def __init__(
        self, policy: Policy, fills: Fills, miss: MissPath, runtime: Runtime, batch: L2Batch
    ) -> None:
        self._policy = policy
        self._fills = fills
        self._miss = miss
        self._rt = runtime
        self._batch = batch

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
        """Each value under its lease, in one pipeline (hot keys: ``_replicas``); L1 then."""
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
            return {r.key: self._miss.as_read(r, v) for r, v in zip(reads, values, strict=True)}
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
                fills.fill_l1(read.key, value, soft_expiry, read.seq, tagged)
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
        # Redis down: the leases expire by themselves (lease_ttl).
        with contextlib.suppress(L2Unavailable):
            await self._batch.release_many([lease_name(key) for key in keys], token)


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
