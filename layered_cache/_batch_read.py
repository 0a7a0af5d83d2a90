"""The read half of a batch: L1 first, then one MGET (a replica's name for a hot key),
decoded. Shared by ``get_many`` and ``get_or_load_many``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from layered_cache._codec import Envelope
from layered_cache._fills import Fills
from layered_cache._l1 import MISSING
from layered_cache._l2 import L2Unavailable
from layered_cache._l2batch import L2Batch, Replies
from layered_cache._policy import Policy
from layered_cache._refresh import Refresher
from layered_cache._runtime import Runtime

__all__ = ["BatchReader"]


class BatchReader:
    def __init__(
        self, policy: Policy, fills: Fills, refresher: Refresher, runtime: Runtime, batch: L2Batch
    ) -> None:
        self._policy = policy
        self._fills = fills
        self._refresher = refresher
        self._rt = runtime
        self._batch = batch

    def from_l1(self, keys: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
        """(L1 hits, the distinct keys L1 doesn't have, in order)."""
        found: dict[str, Any] = {}
        missing: list[str] = []
        l1 = self._policy.l1
        for key in dict.fromkeys(keys):
            if l1 is not None and (value := l1.get(key)) is not MISSING:
                self._policy.stats.l1_hit += 1
                found[key] = value
            else:
                missing.append(key)
        return found, missing

    async def read_many(
        self, keys: list[str], *, fresh_bases: bool = False
    ) -> dict[str, Envelope[Any] | None]:
        """One MGET of ``keys`` (a replica's name for a hot key), decoded. A key whose
        master failed (a cluster: ``L2Batch``) is left out, neither a hit nor a miss;
        ``L2Unavailable`` if none could be read. ``fresh_bases`` (``get_many``, which
        takes no lease): a hot key whose replica was there but gave no fresh value is
        read from its base key too (``_fresh_bases``)."""
        policy, store = self._policy, self._rt.store
        names = list(keys)
        hot: dict[str, int] = {}
        if policy.hot is not None and policy.replicas:
            for position, key in enumerate(keys):
                if policy.hot.record(key):
                    index, names[position] = store.placement.pick(key, policy.replicas)
                    hot[key] = index
        data = _answered(keys, await self._batch.get_many(names))
        from_replicas = [key for key in hot if data.get(key) is not None]
        if hot:
            await self._replica_misses(hot, data)
        decoded = {key: self._fills.decode(key, value) for key, value in data.items()}
        alive = await self._alive(decoded)
        if fresh_bases and from_replicas:
            await self._fresh_bases(from_replicas, alive)
        return alive

    async def _fresh_bases(
        self, from_replicas: list[str], envelopes: dict[str, Envelope[Any] | None]
    ) -> None:
        """Hot keys whose replica was there but unusable (soft-expired after an instance
        where the key is not hot refilled only the base, undecodable, a dead tag) while
        the base key may be fresh: one more MGET of their base keys; a fresh one is
        served and copied to the replicas, as a single ``get()`` does
        (``Refresher.fresh_base``). ``get_or_load_many`` finds it under the lease."""
        now = self._rt.clock()
        unusable = [
            key for key in from_replicas
            if (envelope := envelopes[key]) is None or now >= envelope.soft_expiry
        ]
        if not unusable:
            return
        try:
            base = _answered(unusable, await self._batch.get_many(unusable))
        except L2Unavailable:
            return  # the replicas' answers stand
        decoded = await self._alive({k: self._fills.decode(k, v) for k, v in base.items()})
        now = self._rt.clock()
        for key, envelope in decoded.items():
            if envelope is not None and now < envelope.soft_expiry:
                envelopes[key] = envelope
                self._refresher.copy_to_replicas(key)

    async def _alive(
        self, decoded: dict[str, Envelope[Any] | None]
    ) -> dict[str, Envelope[Any] | None]:
        """Tagged entries whose tag was invalidated are dead (not even stale). Tags this
        instance hasn't seen are fetched first, all in one round trip."""
        tagged = {k: e.tags for k, e in decoded.items() if e is not None and e.tags is not None}
        if not tagged:
            return decoded
        verdicts = await self._fills.versions.valid_many(list(tagged.values()))
        for key, valid in zip(tagged, verdicts, strict=True):
            if not valid:
                decoded[key] = None
        return decoded

    async def _replica_misses(self, hot: dict[str, int], data: dict[str, bytes | None]) -> None:
        """A hot key whose replica was missing, or whose replica's master failed: read the
        base key (one more MGET; it may be on a healthy master) and, for a missing one,
        start copying it to the replicas, as a single read does."""
        stats = self._policy.stats
        for key, index in hot.items():
            if data.get(key) is not None:
                stats.replica_reads[index] += 1
        empty = [key for key in hot if key in data and data[key] is None]
        again = empty + [key for key in hot if key not in data]
        if not again:
            return
        stats.replica_miss += len(empty)
        placement = self._rt.store.placement
        for key in again:
            placement.move_on(key)
        try:
            base = _answered(again, await self._batch.get_many(again))
        except L2Unavailable:
            base = {}  # these keys stay unread; the others were read
        for key in again:
            if key not in base:
                data.pop(key, None)
                continue
            data[key] = base[key]
            if base[key] is not None and key in empty:
                self._refresher.copy_to_replicas(key)


def _answered(keys: list[str], replies: Replies[bytes | None]) -> dict[str, bytes | None]:
    """Each key's reply, the keys whose master failed left out."""
    if not replies.failed:
        return dict(zip(keys, replies.values, strict=True))
    return {
        key: value
        for position, (key, value) in enumerate(zip(keys, replies.values, strict=True))
        if position not in replies.failed
    }
