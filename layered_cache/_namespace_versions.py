"""One namespace's view of the shared tag versions (``_tags.TagVersions``).

Without the backplane's word (off, disconnected, stalled) an instance can't know that a
token it holds is still current; how long it may act on one anyway is the bound a key
invalidation has on this namespace: its L1 TTL, the most a copy of a deleted key lives
here unheard of. Without L1 that bound is none at all; ``NO_L1_ALLOWANCE`` stands in
for it, so that the moments between the listener's reads (applying a reply, the
coalesce pause) don't make every read of a healthy instance ask Redis. So each
namespace asks the shared versions with its own ``within``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from layered_cache._policy import Policy
from layered_cache._tags import TagVersions

__all__ = ["NO_L1_ALLOWANCE", "NamespaceVersions"]

NO_L1_ALLOWANCE = 0.05  # seconds: ``within`` for a namespace without L1


class NamespaceVersions:
    def __init__(self, shared: TagVersions, policy: Policy) -> None:
        self._shared = shared
        self._within = policy.l1_ttl if policy.l1 is not None else NO_L1_ALLOWANCE

    @property
    def generation(self) -> int:
        return self._shared.generation

    def invalidated_since(self, tags: Iterable[str], generation: int) -> bool:
        return self._shared.invalidated_since(tags, generation)

    def known(self, tags: Mapping[str, str]) -> bool | None:
        return self._shared.known(tags, self._within)

    def unvouched_for(self, tags: Mapping[str, str]) -> float | None:
        return self._shared.unvouched_for(tags, self._within)

    async def current(self, tags: Iterable[str]) -> dict[str, str]:
        return await self._shared.current(tags, self._within)

    async def valid(self, tags: Mapping[str, str]) -> bool:
        return await self._shared.valid(tags, self._within)

    async def valid_many(self, entries: Sequence[Mapping[str, str]]) -> list[bool]:
        return await self._shared.valid_many(entries, self._within)
