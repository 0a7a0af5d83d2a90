"""The facade's reads, ``LayeredCache.get_or_load`` and ``get``: the L1-hit path.

They repeat the namespace's L1-hit path (``Namespace.get_or_load``) in their own
coroutine and await the namespace only past it, so an L1 hit costs one coroutine and no
call, as a hand-written cache-aside wrapper around a TLRUCache does; ``bench/l1_hit.py``
measures both against one (each extra frame is ~10 % of a hit). Even the key build is
read inline for a one-field template's int or str value seen before (the memo
``KeyTemplate.build`` reads first: ~30 ns, 5 % of a hit); anything else is built, and
a bad value raises there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from layered_cache._miss import TagsOf
from layered_cache._namespace import Namespace

__all__ = ["HitPath"]

T = TypeVar("T")


class HitPath:
    """Mixed into ``LayeredCache``, which holds the namespaces."""

    _namespaces: dict[str, Namespace]

    def namespace(self, name: str) -> Namespace:
        raise NotImplementedError

    async def get_or_load(
        self,
        namespace: str,
        fields: Mapping[str, object],
        loader: Callable[[], Awaitable[T]],
        tags: TagsOf | None = None,
    ) -> T:
        """The value from L1, else L2, else ``loader()`` (one load per key fleet-wide).
        Returns what L2 decodes to: declare the namespace's value type (``value_types``
        or a ``cached`` function's annotation) so that is the loader's type. ``tags``
        (a ``tags = true`` namespace): the value's tags, a list or a function of the
        loaded value; ``invalidate_tag`` of any of them kills the entry."""
        try:  # a subscript, not .get(): a method call is ~5 % of a hit
            ns = self._namespaces[namespace]
        except KeyError:
            ns = self.namespace(namespace)  # raises, naming the configured ones
        memo = ns._key_memo
        if memo is None:
            key = ns._build(fields)
        else:  # a one-field template's value seen before: its key without a call
            field, known = memo
            try:
                value = fields[field]
                kind = type(value)
                key = (
                    known[value]
                    if (kind is str or kind is int) and len(fields) == 1
                    else ns._build(fields)  # ...or raises, naming a field it doesn't know
                )
            except (LookupError, TypeError):
                key = ns._build(fields)  # builds and remembers it, or raises naming the field
        entries = ns._l1_entries
        if entries is not None and tags is None:
            try:
                value = entries[key]
            except KeyError:
                pass
            else:
                ns._stats.l1_hit += 1
                return value  # type: ignore[no-any-return]
        return await ns._get_or_load(key, loader, tags)

    async def get(self, namespace: str, fields: Mapping[str, object]) -> Any:
        """The cached value or None; never loads. Stale values count as absent."""
        try:  # a subscript, not .get(): a method call is ~5 % of a hit
            ns = self._namespaces[namespace]
        except KeyError:
            ns = self.namespace(namespace)  # raises, naming the configured ones
        memo = ns._key_memo
        if memo is None:
            key = ns._build(fields)
        else:  # a one-field template's value seen before: its key without a call
            field, known = memo
            try:
                value = fields[field]
                kind = type(value)
                key = (
                    known[value]
                    if (kind is str or kind is int) and len(fields) == 1
                    else ns._build(fields)  # ...or raises, naming a field it doesn't know
                )
            except (LookupError, TypeError):
                key = ns._build(fields)  # builds and remembers it, or raises naming the field
        entries = ns._l1_entries
        if entries is not None:
            try:
                value = entries[key]
            except KeyError:
                pass
            else:
                ns._stats.l1_hit += 1
                return value
        return await ns._get(key)

