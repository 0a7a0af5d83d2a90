"""One namespace of the cache (a region, in dogpile.cache's terms): its policy, L1,
codec, stats and hot-key detector, and the read path that uses them, top-down:

    L1 -> single-flight -> L2 (a random replica if hot) -> on a miss, ``miss.py``:
    lease -> loader -> leased fill (``replicas.py`` for hot keys)

A Redis failure falls through to the loader; a loader failure falls back to a stale
value within ``stale.max_age``. Storage is injected (``Runtime``): this module decides
the order of steps and owns no Redis command.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from layered_cache import _replicas as replicas
from layered_cache._clients import REDIS_FAILURES
from layered_cache._codec import Codec, Envelope
from layered_cache._fills import Fills
from layered_cache._keys import replica_name
from layered_cache._l1 import MISSING
from layered_cache._l2 import L2Unavailable
from layered_cache._miss import MissPath, Read
from layered_cache._policy import Policy
from layered_cache._refresh import Refresher
from layered_cache._runtime import Runtime

__all__ = ["Namespace"]

T = TypeVar("T")


class Namespace:
    """The cache of one namespace. Get it with ``cache.namespace("book")``."""

    def __init__(self, policy: Policy, runtime: Runtime) -> None:
        self.name = policy.name
        self.policy = policy
        self._rt = runtime
        self._fills = Fills(policy, runtime.clock)
        self._miss = MissPath(policy, self._fills, runtime)
        self._refresher = Refresher(policy, self._miss, runtime)
        self._type_declared_by = "value_types"

    def key(self, fields: Mapping[str, object]) -> str:
        """The full Redis key for these fields (validated)."""
        return self.policy.template.build(fields)

    def _declare_type(self, value_type: Any, *, by: str) -> None:
        """Reads of this namespace decode L2 values into ``value_type``. One type per
        namespace: a second, different declaration is an error, not silently ignored
        (whichever came first would otherwise decide what every read returns)."""
        if value_type is Any:
            return
        current = self.policy.codec.value_type
        if current is Any:
            self.policy.codec = Codec(value_type)
            self._type_declared_by = by
        elif current != value_type:
            raise TypeError(
                f"namespace {self.name!r} already decodes into {current!r} (declared by "
                f"{self._type_declared_by}); {by} declares {value_type!r}"
            )

    def stats(self) -> dict[str, int | dict[int, int]]:
        return self.policy.stats.as_dict()

    def hot_keys(self) -> dict[str, float]:
        """Current hot keys with their measured L2 read rate (reads/s)."""
        return self.policy.hot.hot_keys() if self.policy.hot is not None else {}

    # -- reads -------------------------------------------------------------------------

    async def get_or_load(
        self, fields: Mapping[str, object], loader: Callable[[], Awaitable[T]]
    ) -> T:
        """The value from L1, else L2, else ``loader()`` (one load per key fleet-wide)."""
        policy = self.policy
        key = policy.template.build(fields)
        if not policy.cache:
            policy.stats.miss += 1
            policy.stats.load += 1
            return await loader()
        l1 = policy.l1
        if l1 is not None:
            value = l1.get(key)
            if value is not MISSING:
                policy.stats.l1_hit += 1
                return value  # type: ignore[no-any-return]
        value, shared = await self._rt.flight.do(key, lambda: self._fetch(key, loader))
        if shared:
            policy.stats.coalesced += 1
        return value  # type: ignore[no-any-return]

    async def get(self, fields: Mapping[str, object]) -> Any:
        """The cached value or None; never loads. Stale values count as absent."""
        policy = self.policy
        key = policy.template.build(fields)
        if not policy.cache:
            return None
        if policy.l1 is not None:
            value = policy.l1.get(key)
            if value is not MISSING:
                policy.stats.l1_hit += 1
                return value
        if not policy.l2:
            return None
        read_seq = policy.l1.begin_read() if policy.l1 is not None else None
        try:
            envelope = await self._read_l2(key)
        except L2Unavailable:
            policy.stats.redis_error += 1
            return None
        if envelope is None or self._rt.clock() >= envelope.soft_expiry:
            return None
        policy.stats.l2_hit += 1
        self._fills.fill_l1(key, envelope.value, envelope.soft_expiry, read_seq)
        return envelope.value

    async def _fetch(self, key: str, loader: Callable[[], Awaitable[Any]]) -> Any:
        policy = self.policy
        read = Read(key, policy.l1.begin_read() if policy.l1 is not None else None)
        envelope: Envelope[Any] | None = None
        if policy.l2:
            try:
                envelope = await self._read_l2(key)
            except L2Unavailable:
                policy.stats.redis_error += 1
                return await self._miss.load_unleased(read, loader)
        now = self._rt.clock()
        if envelope is not None and now < envelope.soft_expiry:
            policy.stats.l2_hit += 1
            self._refresher.maybe_refresh_early(key, envelope, loader, now)
            self._fills.fill_l1(key, envelope.value, envelope.soft_expiry, read.seq)
            return envelope.value
        policy.stats.miss += 1
        if not policy.l2:
            value = await self._miss.load_unleased(read, loader)
            self._fills.fill_l1(key, value, None, read.seq)
            return value
        read.stale = envelope if self._fills.within_stale(envelope, now) else None
        return await self._miss.load_under_lease(read, loader)

    async def _read_l2(self, key: str) -> Envelope[Any] | None:
        # One coroutine, no wrapper: every await level costs a resumption per hop on
        # the L2-hit path, which is measured against a raw GET.
        policy, store = self.policy, self._rt.store
        observers = self._rt.hooks.l2_observers
        started = time.perf_counter() if observers else 0.0
        data: bytes | None
        if policy.hot is not None and policy.replicas and policy.hot.record(key):
            index = store.placement.pick(key, policy.replicas)  # balanced per master
            data = await store.get(replica_name(key, index))
            if data is not None:
                policy.stats.replica_reads[index] += 1
            else:
                policy.stats.replica_miss += 1
                data = await store.get(key)
                if data is not None:
                    self._refresher.copy_to_replicas(key)
        else:
            data = await store.get(key)
        if observers:
            elapsed = time.perf_counter() - started
            for observe in observers:
                observe(policy.name, elapsed)
        return self._fills.decode(key, data)

    # -- writes ------------------------------------------------------------------------

    async def set(self, fields: Mapping[str, object], value: Any) -> None:
        """Write ``value`` to L2 (base and replicas) and this instance's L1; other
        instances drop their L1 copy through the backplane.

        Raises ``L2Unavailable`` if Redis fails, including when the value was written
        but the backplane append failed: then other instances may still serve their old
        L1 copy for its TTL, and returning normally would promise otherwise."""
        policy = self.policy
        key = policy.template.build(fields)
        if not policy.cache:
            return
        policy.stats.set += 1
        self._rt.flight.forget(key)
        read_seq: int | None = None
        if policy.l1 is not None:
            policy.l1.discard([key])
            # Like every other L1 fill: a remote set()/invalidate() of this key that
            # reaches us (backplane) while our write is in flight tombstones the key,
            # and then our value is superseded and must not sit in L1 for its TTL.
            read_seq = policy.l1.begin_read()
        if not policy.l2:
            self._fills.fill_l1(key, value, None, read_seq)
            return
        soft_expiry = self._rt.clock() + policy.l2_ttl_draw()
        encoded = self._fills.encode(key, value, soft_expiry, 0.0)
        if encoded is None:
            return
        data, value = encoded
        names, outdated = replicas.set_plan(key, policy.replicas, self._fills.is_hot(key))
        await replicas.write(
            self._rt.store, names, outdated, data, self._fills.redis_ttl_ms(soft_expiry)
        )
        await self._announce_set(key)
        self._settle_after_set(key, value, soft_expiry, read_seq)

    async def _announce_set(self, key: str) -> None:
        try:
            await self._rt.invalidator.announce([key])
        except REDIS_FAILURES as exc:
            # L2 holds our value, but the other instances were not told to drop their L1
            # copies: set() must not return as if the write had reached everyone (like
            # invalidate(), it raises). Our own L1 is left empty: reads here go to L2.
            self.policy.stats.redis_error += 1
            self._forget([key])
            raise L2Unavailable(
                f"set() wrote L2 but could not announce it on the backplane: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _settle_after_set(
        self, key: str, value: Any, soft_expiry: float, read_seq: int | None
    ) -> None:
        """After our write landed: a load of this key that began while it was in flight
        may have read the value we replaced. Detach it (later callers must not join it)
        and tombstone the key again (its L1 fill is refused), then fill L1 with our value
        - unless a remote set()/invalidate() overtook ours meanwhile. No await in here:
        nothing can run between the checks and the fill."""
        self._rt.flight.forget(key)
        l1 = self.policy.l1
        if l1 is None:
            return
        superseded = read_seq is not None and l1.invalidated_since(key, read_seq)
        l1.discard([key])
        if superseded:
            self.policy.stats.l1_fill_discarded += 1
            return
        self._fills.fill_l1(key, value, soft_expiry, l1.begin_read())

    def _forget(self, keys: list[str]) -> int:
        """Drop ``keys`` from L1 and detach their in-flight loads: a load that began
        before an invalidation may return the old value; callers arriving after it start
        a fresh load instead of joining it. The old load's own fills are refused anyway
        (its lease is gone, its L1 read_seq is older than the tombstone)."""
        for key in keys:
            self._rt.flight.forget(key)
        return self.policy.l1.discard(keys) if self.policy.l1 is not None else 0
