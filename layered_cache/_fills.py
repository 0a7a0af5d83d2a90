"""How one namespace's values enter and leave the layers: L2 bytes decoded and encoded
(``_envelopes``), L1 filled for no longer than L2's freshness (nor a tagged entry for
longer than its versions are vouched for), the hard TTL in Redis, whether a key is hot
here, and the stale window. Shared by the hit path (``_namespace``) and the miss path
(``_miss``), so neither reaches into the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from layered_cache import _envelopes as envelopes
from layered_cache._codec import Envelope
from layered_cache._l2 import L2Unavailable
from layered_cache._namespace_versions import NamespaceVersions
from layered_cache._policy import Policy
from layered_cache._tagindex import TagIndex
from layered_cache._tags import TagsOf, TagVersions, tag_names

__all__ = ["FillWatch", "Fills"]


class Fills:
    def __init__(self, policy: Policy, clock: Callable[[], float], versions: TagVersions) -> None:
        self._policy = policy
        self._clock = clock
        self.versions = NamespaceVersions(versions, policy)  # trusted as long as it may
        l1 = policy.l1
        self.tagged = TagIndex(l1.max_entries) if l1 is not None else None

    def decode(self, key: str, data: bytes | None) -> Envelope[Any] | None:
        return envelopes.decode(self._policy, key, data)

    def recheck(self, data: bytes | None) -> Envelope[Any] | None:
        return envelopes.recheck(self._policy, data)

    def encode(
        self,
        key: str,
        value: Any,
        soft_expiry: float,
        delta: float,
        tags: dict[str, str] | None = None,
        now: float | None = None,
    ) -> envelopes.Encoded:
        """The envelope bytes (None: not cacheable) and the value as L2 readers will
        decode it: see ``envelopes``. ``now``: the write's time, if the caller read the
        clock already."""
        now = self._clock() if now is None else now
        return envelopes.encode(self._policy, key, value, now, soft_expiry, delta, tags)

    def kept_in_l1(self, key: str, value: Any, read_seq: int | None, tagged: bool) -> Any:
        """``value`` as an L2 hit returns it, and in L1 though not in L2 (Redis down or
        full): else every read of the key loads again meanwhile, and the database sees
        the whole read rate, not one load per key per instance and L1 TTL. Not a tagged
        value (its tags' versions are unknown without Redis) nor one L2 couldn't take
        (not encodable, too large); not a key invalidated since ``read_seq``."""
        soft_expiry = self._policy.soft_expiry(value, self._clock())
        encoded = self.encode(key, value, soft_expiry, 0.0)
        if encoded.data is not None and not tagged:
            self.fill_l1(key, encoded.value, soft_expiry, read_seq)
        return encoded.value

    def fill_l1(
        self,
        key: str,
        value: Any,
        soft_expiry: float | None,
        read_seq: int | None,
        tags: Mapping[str, str] | None = None,
        *,
        loaded: bool = False,
    ) -> None:
        """L1 takes ``value`` unless the key was invalidated since ``read_seq`` or, for a
        tagged value, one of its tags was (its versions are no longer current).

        A tagged entry read from L2 was judged alive by versions last vouched for a while
        ago (their fetch, or the backplane's last word: up to the L1 TTL ago when the
        backplane is off or stalled, ``NamespaceVersions``): its copy lives its L1 TTL
        counted from then, not from now, else a tag invalidation not heard of here let
        it live up to twice the L1 TTL. ``loaded``: a value this instance just loaded
        (under its lease) or wrote, not an entry judged by its versions: not shortened."""
        l1 = self._policy.l1
        if l1 is None:
            return
        ttl = self._policy.l1_ttl_draw()
        if tags:
            unvouched = self.versions.unvouched_for(tags)
            if unvouched is None:  # a tag invalidated, or not vouched for any more
                self._policy.stats.l1_fill_discarded += 1
                return
            ttl -= 0.0 if loaded else unvouched
        if soft_expiry is not None:
            ttl = min(ttl, soft_expiry - self._clock())  # never outlive L2's freshness
        if not l1.put(key, value, ttl, read_seq):
            if ttl > 0:
                self._policy.stats.l1_fill_discarded += 1
            return
        if tags:
            self._index(key, tags)

    def settle_l1(
        self,
        entries: Sequence[tuple[str, Any, float]],
        read_seq: int,
        tags: Mapping[str, str] | None = None,
        held: frozenset[str] = frozenset(),
    ) -> None:
        """After a write landed (``set``, ``set_many``): L1 takes each (key, value,
        soft_expiry) in place of what it held (``L1Cache.replace_many``; ``held``: the
        keys it held as the write began), the tags
        checked once; a key the write was overtaken on, or all of them when a tag was
        invalidated since, is dropped instead (and counted as a discarded fill)."""
        l1 = self._policy.l1
        if l1 is None or not entries:
            return
        if tags and self.versions.known(tags) is not True:
            l1.replace_many([(key, value, 0.0) for key, value, _ in entries], read_seq)
            self._policy.stats.l1_fill_discarded += len(entries)
            return
        now, draw = self._clock(), self._policy.l1_ttl_draw
        items = [(key, value, min(draw(), soft - now)) for key, value, soft in entries]
        self._policy.stats.l1_fill_discarded += l1.replace_many(items, read_seq, held)
        if tags:
            for key, _, _ in entries:
                if key in l1:
                    self._index(key, tags)

    async def fill_l1_only(
        self, loaded: list[tuple[str, int | None, Any]], tags_of: TagsOf | None, generation: int
    ) -> None:
        """Fill L1 with (key, read_seq, value)s loaded for an ``l2 = false`` namespace.
        A tagged value is indexed under its tags' current versions, so ``invalidate_tag``
        drops it, and is not kept if one of them was invalidated while it loaded
        (``generation``: ``versions.generation`` before the load): it may predate that.
        (With L2, the lease ``invalidate_tag`` revokes does that.)"""
        names = [tag_names(tags_of, value) if tags_of else [] for _, _, value in loaded]
        current: dict[str, str] = {}
        if tags_of is not None:
            try:
                current = await self.versions.current(t for each in names for t in each)
            except L2Unavailable:  # the tags' versions unknown: not kept
                self._policy.stats.redis_error += 1
                return
        for (key, read_seq, value), each in zip(loaded, names, strict=True):
            if each and self.versions.invalidated_since(each, generation):
                self._policy.stats.l1_fill_discarded += 1
                continue
            tagged = {t: current[t] for t in each} or None
            self.fill_l1(key, value, None, read_seq, tagged, loaded=True)

    def _index(self, key: str, tags: Mapping[str, str]) -> None:
        l1 = self._policy.l1
        assert l1 is not None and self.tagged is not None
        self.tagged.add(key, tags, l1.__contains__)

    def forget_tag(self, tag: str) -> list[str]:
        """The L1 keys filled with ``tag`` (now to be dropped)."""
        return list(self.tagged.pop(tag)) if self.tagged is not None else []

    def alive(self, envelope: Envelope[Any]) -> bool:
        """False for a tagged entry whose tag this instance knows was invalidated (an
        unknown tag counts as alive here: used for fills just written by their owner)."""
        return envelope.tags is None or self.versions.known(envelope.tags) is not False

    def redis_ttl_ms(self, soft_expiry: float, now: float | None = None) -> int:
        """Hard expiry = soft expiry + the stale window the fail-safe may serve from."""
        now = self._clock() if now is None else now
        return max(1, int((soft_expiry - now + self._policy.stale_max_age) * 1000))

    def is_hot(self, key: str) -> bool:
        policy = self._policy
        return policy.hot is not None and policy.replicas > 0 and policy.hot.is_hot(key)

    def within_stale(self, envelope: Envelope[Any] | None, now: float) -> bool:
        return envelope is not None and now - envelope.soft_expiry <= self._policy.stale_max_age


class FillWatch:
    """What a lease waiter accepts as the winner's fill: a fresh, live envelope of the
    key. Each read is decoded once and the accepted envelope kept (a large value costs
    one decode); undecodable bytes (a deploy with another value type filled it) are
    counted and logged once per wait, not at every re-read."""

    def __init__(self, fills: Fills, key: str, clock: Callable[[], float]) -> None:
        self._fills = fills
        self._key = key
        self._clock = clock
        self._told = False
        self.accepted: Envelope[Any] | None = None

    def usable(self, data: bytes | None) -> bool:
        fills = self._fills
        envelope = fills.recheck(data) if self._told else fills.decode(self._key, data)
        self._told = self._told or (envelope is None and data is not None)
        if envelope is None or self._clock() >= envelope.soft_expiry:
            return False
        if not fills.alive(envelope):
            return False
        self.accepted = envelope
        return True
