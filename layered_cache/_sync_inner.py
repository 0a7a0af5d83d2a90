"""The inner caches of a ``SyncLayeredCache``, and what goes on from one to the next.

The facade builds a new ``LayeredCache`` in a forked child (the parent's is the parent's)
and after ``close()`` + ``start()``. What was bound to the one before must go on with
it: without that, a worker of ``gunicorn --preload`` lost the value types its module's
``@cache.cached`` declared at import (an L2 hit came back as a dict, not the declared
Struct, against DESIGN.md's "a call returns the same type whichever layer answered it"),
and its ``/metrics`` showed the master's counters frozen at the fork. So every inner
cache is built with the value types declared so far and the same ``Hooks`` contents
(Prometheus's observers, tracing's load wrapper), and is recorded as the facade's:
what was handed an inner cache (``register_cache(sync_cache.cache)``, docs/metrics.md)
follows the facade (``facade_of``) to the one it runs now.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from layered_cache._cache import LayeredCache
from layered_cache._config import Config
from layered_cache._namespace import Namespace
from layered_cache._runtime import Hooks

if TYPE_CHECKING:
    from layered_cache.sync import SyncLayeredCache

__all__ = ["InnerCaches", "facade_of"]

# Weak both ways: neither the inner cache nor its facade keeps the other alive.
_BUILT_BY: weakref.WeakKeyDictionary[LayeredCache, weakref.ref[SyncLayeredCache]] = (
    weakref.WeakKeyDictionary()
)


def facade_of(cache: LayeredCache) -> SyncLayeredCache | None:
    """The ``SyncLayeredCache`` that built ``cache``, if one did and is still alive."""
    built_by = _BUILT_BY.get(cache)
    return built_by() if built_by is not None else None


class InnerCaches:
    """Builds one facade's inner caches from ``config``, the constructor's ``kwargs``
    and what was bound to the inner caches before."""

    def __init__(self, config: Config, kwargs: dict[str, Any]) -> None:
        self._config = config
        self._value_types: dict[str, Any] = dict(kwargs.pop("value_types", None) or {})
        self._kwargs = kwargs
        # The latest inner cache's (a fresh one before the first): its lists are the
        # ones every inner cache is built with, so a hook added to one is on all.
        self.hooks = Hooks()

    def declare(self, namespace: Namespace, value_type: Any, by: str) -> None:
        """Declare ``value_type`` (``cached`` does, at decoration or at the first call)
        on ``namespace``, of the inner cache running now, and remember it for the inner
        caches built after this one."""
        namespace._declare_type(value_type, by=by)
        declared = namespace.policy.codec.value_type
        if declared is not Any:
            self._value_types[namespace.name] = declared

    async def open(self, facade: SyncLayeredCache) -> LayeredCache:
        """A started cache for ``facade`` (on its loop). ``start`` waits, bounded, until
        its backplane listener knows its position in the stream: see
        ``LayeredCache._backplane_positioned``."""
        types = dict(self._value_types)
        cache = LayeredCache.from_config(self._config, value_types=types, **self._kwargs)
        hooks, before = cache.hooks, self.hooks
        hooks.load_observers = before.load_observers
        hooks.l2_observers = before.l2_observers
        hooks.load_wrapper = before.load_wrapper
        # The new cache's from here: a wrapper set while start() awaits Redis (another
        # thread's ``instrument``) landed on the old object, and no load was traced.
        self.hooks = hooks
        try:
            await cache.start()
        except BaseException:
            before.load_wrapper = hooks.load_wrapper  # one set meanwhile goes on too
            self.hooks = before
            raise
        _BUILT_BY[cache] = weakref.ref(facade)
        return cache
