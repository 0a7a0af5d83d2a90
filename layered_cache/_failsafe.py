"""The fail-safe: serve the expired value a read found when its load fails or is slow,
but never one an invalidation or a newer write has superseded.

A stale value is served only within ``stale.max_age``, only if this instance heard no
invalidation of the key since the read began (the L1 tombstone) and knows its tags to
be current, and only if L2 still holds that very value (one GET, on this path only).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog

from layered_cache._codec import Envelope
from layered_cache._fills import Fills
from layered_cache._l2 import L2Unavailable
from layered_cache._policy import Policy
from layered_cache._runtime import Runtime
from layered_cache._tags import TagsOf

__all__ = ["FailSafe", "Misshapen", "Read"]

_log = structlog.get_logger("layered_cache")


@dataclass(slots=True)
class Read:
    """One request's view of a key: threaded through the miss path instead of loose
    arguments. ``seq``: the namespace's invalidation sequence when the L2 read began
    (``Policy.marks``: its L1's, or without L1 tombstones of its own, which only
    ``Served`` reads); ``stale``: the expired value the fail-safe may serve."""

    key: str
    seq: int | None
    stale: Envelope[Any] | None = None
    tags_of: TagsOf | None = None  # the tags of a loaded value (tagged namespaces)
    generation: int | None = None  # the tag versions' when it began (``_served``)
    revoked: bool = False  # its fill was refused: a write or an invalidation overtook it
    owned: bool = False  # the loader's own object, stored nowhere (it can't be encoded)
    handed_over: bool = False  # its lease went to a background fill (``BatchFill._finish``)


class Misshapen(TypeError, ValueError):
    """``load_many`` returned something other than one value per key, in order: a bug in
    it, raised wherever it shows (a batch, a key handed to the single-key path, a load
    without leases) even where a stale value could be served, which would hide it. Both
    a TypeError (a return that is no list) and a ValueError (a wrong count), as before."""


class FailSafe:
    def __init__(self, policy: Policy, fills: Fills, runtime: Runtime) -> None:
        self._policy = policy
        self._fills = fills
        self._rt = runtime

    async def serve_or_raise(self, read: Read, exc: Exception) -> Any:
        """The loader failed: ``read.stale`` if the fail-safe may serve it, else ``exc``."""
        if isinstance(exc, Misshapen) or not await self.usable(read):
            raise exc
        assert read.stale is not None
        self._policy.stats.stale_served += 1
        _log.warning(
            "loader_failed_serving_stale",
            namespace=self._policy.name,
            key=read.key,
            error=type(exc).__name__,
        )
        return read.stale.value

    async def usable(self, read: Read) -> bool:
        """Whether ``read.stale`` may be served: within ``stale.max_age`` and
        not invalidated or overwritten since we read it. The load may have run for
        seconds, so "still the value in L2" is re-read (one GET, only on this fallback
        path): an invalidation deletes the key, a set() replaces it. The local tombstone
        catches an invalidation already delivered by the backplane without a round trip.
        If Redis can't confirm, don't serve: an invalidated value is never a fallback."""
        stale = read.stale
        if stale is None or not self._fills.within_stale(stale, self._rt.clock()):
            return False
        if not self._still_current(read):
            return False
        try:
            current = self._fills.recheck(await self._rt.store.get(read.key))
        except L2Unavailable:
            return False
        # Again after the GET: an invalidation delivered while its reply was in flight
        # (the backplane is another connection) must not be missed.
        return (
            self._still_current(read)
            and current is not None
            and current.written_at == stale.written_at
            and current.soft_expiry == stale.soft_expiry
        )

    def _still_current(self, read: Read) -> bool:
        """Not invalidated here since ``read`` began (tombstone), nor a tag of its stale
        value (or a tag this instance can't confirm)."""
        stale = read.stale
        if stale is not None and stale.tags and self._fills.versions.known(stale.tags) is not True:
            return False
        l1 = self._policy.l1
        return not (
            l1 is not None and read.seq is not None and l1.invalidated_since(read.key, read.seq)
        )

    async def serve_all_or_raise(self, reads: list[Read], exc: Exception) -> dict[str, Any]:
        """A batch's load failed: the stale values if every one may be served, else
        ``exc`` (a batch can't return half its values)."""
        if isinstance(exc, Misshapen):
            raise exc
        usable = await asyncio.gather(*(self.usable(read) for read in reads))
        if not all(usable):
            raise exc
        self._policy.stats.stale_served += len(reads)
        return {read.key: read.stale.value for read in reads if read.stale is not None}
