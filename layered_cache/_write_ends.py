"""How a ``set()`` tells the fleet, or undoes itself (``_writes``): its announcement when
it did not ride in the write (stream, else pub/sub: ``Invalidator.announce``), what is
left to do once its caller was cancelled or its write failed, and the drop of keys
whose new values can't be stored."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from layered_cache._backoff import Backoff
from layered_cache._clients import REDIS_FAILURES
from layered_cache._l2 import L2Unavailable
from layered_cache._policy import Policy
from layered_cache._runtime import Runtime

__all__ = ["DROP_ATTEMPTS", "WriteEnds"]

# ``WriteEnds.drop_later``: attempts, and the backoff between them (seconds): at most
# about 4 s in all at the default ``redis.timeout`` (100 ms), within
# ``Runtime.ORPHAN_GRACE`` (5 s), which ``close()`` waits for it.
DROP_ATTEMPTS = 6
DROP_BACKOFF = 0.1
DROP_BACKOFF_CAP = 1.6


class WriteEnds:
    """One namespace's: ``forget`` drops keys from its L1 and tombstones them."""

    def __init__(
        self, policy: Policy, runtime: Runtime, forget: Callable[[list[str]], object]
    ) -> None:
        self._policy = policy
        self._rt = runtime
        self._forget = forget

    async def announce_or_abandon(self, keys: list[str]) -> None:
        """``announce``; our caller cancelled meanwhile, it goes on in the background."""
        try:
            await self.announce(keys)
        except asyncio.CancelledError:
            self.abandoned(keys, announce=True)
            raise

    def abandoned(self, keys: list[str], *, announce: bool) -> None:
        """Our caller was cancelled once the write was done (or while its announcement
        was in flight), or the write failed: it landed, or may have. Our L1 is left
        empty and the keys tombstoned (a load that read the replaced value must not
        fill it: ``Writes._settle`` won't run); with ``announce``, the announcement is
        sent in the background: others must not keep the replaced value for their L1
        TTL."""
        self._forget(keys)
        if announce:
            self._rt.tasks.spawn_orphan(self.announce_quietly(keys))

    async def announce_quietly(self, keys: list[str]) -> None:
        with contextlib.suppress(L2Unavailable):
            await self.announce(keys)

    async def drop(self, keys: list[str]) -> None:
        """A write whose new values can't be stored drops the keys everywhere instead, as
        ``invalidate()`` does: to completion (a DEL without its announcement would leave
        the other instances their old copies) and dropped from our L1 again after the
        DEL (a read that read L2 before it may have filled the old value; our listener
        skips our own announcement)."""
        try:
            await self._rt.tasks.to_completion(self._drop_steps(keys))
        except REDIS_FAILURES as exc:
            self._policy.stats.redis_error += 1
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc

    def drop_later(self, keys: list[str]) -> None:
        """``drop``, in the background, retried: a failed cluster set() of hot keys
        (``Writes._written``) raises at once, and the master that failed it (stalled,
        failing over) refuses the DELs too for a while. Bounded as a caller's retries of
        ``invalidate()`` are (``DROP_ATTEMPTS``, with backoff): then logged, as any
        orphan's failure, and the keys' L2 TTL bounds what is left."""
        self._forget(keys)
        self._rt.tasks.spawn_orphan(self._drop_retried(keys))

    async def _drop_retried(self, keys: list[str]) -> None:
        backoff = Backoff(base=DROP_BACKOFF, cap=DROP_BACKOFF_CAP)
        for attempt in range(DROP_ATTEMPTS):
            try:
                await self._drop_steps(keys)
                return
            except (*REDIS_FAILURES, L2Unavailable):
                self._policy.stats.redis_error += 1
                if attempt == DROP_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(backoff.next_delay())

    async def _drop_steps(self, keys: list[str]) -> None:
        try:
            await self._rt.invalidator.invalidate((key, self._policy.replicas) for key in keys)
        finally:
            # Also when the DEL or its announcement failed, as ``Coherence._delete``: the
            # DEL may have landed, and a racing read's old copy would outlive it here.
            self._forget(keys)

    async def announce(self, keys: list[str]) -> None:
        try:
            await self._rt.invalidator.announce(keys)
        except (*REDIS_FAILURES, L2Unavailable) as exc:
            # L2 holds our values, but the other instances were not told to drop their
            # L1 copies: set() must not return as if the write had reached everyone (like
            # invalidate(), it raises). Our own L1 is left empty: reads here go to L2.
            self._policy.stats.redis_error += 1
            self._forget(keys)
            wrote = "wrote L2 but " if self._policy.l2 else ""
            raise L2Unavailable(
                f"set() {wrote}could not announce it on the backplane: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
