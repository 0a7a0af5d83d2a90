"""Which L1 keys carry which tag: what ``invalidate_tag`` drops from this instance's L1.

Keys leave L1 by TTL and eviction without telling the index, so it is pruned now and
then against what L1 still holds. Bounded by a running count of (tag, key) pairs, not a
sum over every tag at each fill, and pruned when the count doubles what the last prune
left (at least ``4 x max_entries``): a prune is paid for by as many fills as it kept
pairs. Before, the index kept every tag it ever saw (a tag whose keys had all left
stayed, empty: ~300 B per tag, for ever, with tags of unbounded kinds such as a user),
and pages of more than 4 tags each kept it over its limit after every prune, so every
tagged fill rebuilt it (~280 ms a fill with 2,000 pages of 20 tags in L1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["TagIndex"]


class TagIndex:
    def __init__(self, max_entries: int) -> None:
        self._floor = 4 * max_entries
        self._limit = self._floor
        self._keys: dict[str, set[str]] = {}  # tag -> keys filled into L1 with it
        self._pairs = 0

    def add(self, key: str, tags: Iterable[str], in_l1: Callable[[str], bool]) -> None:
        if self._pairs > self._limit:
            self._prune(in_l1)
        for tag in tags:
            keys = self._keys.setdefault(tag, set())
            if key not in keys:
                keys.add(key)
                self._pairs += 1

    def pop(self, tag: str) -> set[str]:
        """The keys filled with ``tag``, no longer indexed."""
        keys = self._keys.pop(tag, set())
        self._pairs -= len(keys)
        return keys

    def __len__(self) -> int:
        """How many tags are indexed."""
        return len(self._keys)

    def _prune(self, in_l1: Callable[[str], bool]) -> None:
        kept: dict[str, set[str]] = {}
        for tag, keys in self._keys.items():
            alive = {key for key in keys if in_l1(key)}
            if alive:
                kept[tag] = alive
        self._keys = kept
        self._pairs = sum(len(keys) for keys in kept.values())
        self._limit = max(self._floor, 2 * self._pairs)
