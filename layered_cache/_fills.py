"""How one namespace's values enter and leave the layers: L2 bytes decoded and encoded
(``_envelopes``), L1 filled for no longer than L2's freshness, the hard TTL in Redis,
whether a key is hot here, and the stale window. Shared by the hit path
(``_namespace``) and the miss path (``_miss``), so neither reaches into the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layered_cache import _envelopes as envelopes
from layered_cache._codec import Envelope
from layered_cache._policy import Policy

__all__ = ["Fills"]


class Fills:
    def __init__(self, policy: Policy, clock: Callable[[], float]) -> None:
        self._policy = policy
        self._clock = clock

    def decode(self, key: str, data: bytes | None) -> Envelope[Any] | None:
        return envelopes.decode(self._policy, key, data)

    def recheck(self, data: bytes | None) -> Envelope[Any] | None:
        return envelopes.recheck(self._policy, data)

    def encode(
        self, key: str, value: Any, soft_expiry: float, delta: float
    ) -> tuple[bytes, Any] | None:
        """(envelope bytes, the value as L2 readers will decode it) or None: see
        ``envelopes``."""
        return envelopes.encode(self._policy, key, value, self._clock(), soft_expiry, delta)

    def fill_l1(
        self, key: str, value: Any, soft_expiry: float | None, read_seq: int | None
    ) -> None:
        l1 = self._policy.l1
        if l1 is None:
            return
        ttl = self._policy.l1_ttl_draw()
        if soft_expiry is not None:
            ttl = min(ttl, soft_expiry - self._clock())  # never outlive L2's freshness
        if not l1.put(key, value, ttl, read_seq) and ttl > 0:
            self._policy.stats.l1_fill_discarded += 1

    def redis_ttl_ms(self, soft_expiry: float) -> int:
        """Hard expiry = soft expiry + the stale window the fail-safe may serve from."""
        return max(1, int((soft_expiry - self._clock() + self._policy.stale_max_age) * 1000))

    def is_hot(self, key: str) -> bool:
        policy = self._policy
        return policy.hot is not None and policy.replicas > 0 and policy.hot.is_hot(key)

    def within_stale(self, envelope: Envelope[Any] | None, now: float) -> bool:
        return envelope is not None and now - envelope.soft_expiry <= self._policy.stale_max_age
