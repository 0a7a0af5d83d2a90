"""A blocking facade for sync (WSGI: Django, Flask) code: ``SyncLayeredCache``.

    from layered_cache.sync import SyncLayeredCache

    with SyncLayeredCache.from_config(load_config("layered_cache.toml")) as cache:
        book = cache.get_or_load("book", {"id": 42}, lambda: db.book_detail(42))

        @cache.cached("book")
        def book_detail(id: int) -> BookDetail: ...

There is one implementation of the cache: the async ``LayeredCache``. This class runs it
on a private event loop in a daemon thread and submits each call with
``asyncio.run_coroutine_threadsafe``; the calling thread blocks on the result. So
single-flight, leases, hot keys, the backplane and the breaker behave exactly as in
async code, for all threads of the process together (50 threads missing one key cause
one load).

- A sync loader runs in a thread pool (``loop.run_in_executor``) so it never blocks the
  loop; it runs in a copy of the caller's ``contextvars`` context (Flask's app/request
  context, OpenTelemetry's current span, structlog's bound context all carry over).
  Thread-locals do not: a Django loader gets the pool thread's own DB connection, and
  it does not see the caller's uncommitted transaction.
- An L1 hit is answered directly in the calling thread (L1 is thread-safe): no hop to
  the loop thread on the fastest path.
- Nested cached functions are fine: a loader may call the cache again. A loader that
  runs on a pool thread and needs another load (``outer`` calling ``inner``) never
  queues that load behind the pool it occupies, which would deadlock once every pool
  thread ran an ``outer``: a nested load runs on a thread of its own. A loader that
  needs its own key (directly or through other loads) would wait for itself forever:
  that raises ``RecursionError`` naming the key instead.
- Calling it from a running event loop (async code) raises ``RuntimeError``: blocking
  would freeze that loop; use ``LayeredCache`` there.
- It survives a fork (gunicorn ``--preload``, uWSGI, ``multiprocessing``): a cache
  created and started at import is inherited without its loop thread, which only the
  parent has. The child forgets the parent's loop, pool and connections (untouched:
  the parent still uses them) and its first call builds its own, with an empty L1.
  What was bound to the cache goes on with each one built (``_sync_inner``): the value
  types ``cached`` declared, the instrumentation ``hooks`` (metrics, tracing).
- No call waits forever by default: after ``timeout`` (``DEFAULT_TIMEOUT``, 20 s) it
  raises ``SyncTimeoutError`` (a ``TimeoutError``) naming the call; ``timeout=None``
  opts out; anything but None or a number > 0 is a ``ValueError`` at construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import typing
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, ParamSpec, TypeVar

from layered_cache._cache import LayeredCache, RedisStatus
from layered_cache._config import Config
from layered_cache._decorate import cached_sync
from layered_cache._l1 import MISSING
from layered_cache._loader_call import RequestBound
from layered_cache._loopthread import LoopThread, SyncTimeoutError, check_timeout
from layered_cache._miss import TagsOf
from layered_cache._namespace import check_tags
from layered_cache._policy import Policy
from layered_cache._runtime import Hooks
from layered_cache._sync_inner import InnerCaches
from layered_cache._sync_loaders import LoaderThreads, LoaderThreadsExhausted

__all__ = ["DEFAULT_TIMEOUT", "LoaderThreadsExhausted", "SyncLayeredCache", "SyncTimeoutError"]

T = TypeVar("T")
P = ParamSpec("P")

# Seconds a sync call may block by default. Longer than any bound of the cache itself
# (Redis timeouts, the lease's max_wait) plus a slow query, shorter than a WSGI
# server's worker timeout (gunicorn: 30 s), so a stuck call is an exception naming the
# call, not a killed worker.
DEFAULT_TIMEOUT = 20.0


def _forget_parent_after_fork(sync_cache: SyncLayeredCache) -> None:
    """Register the child-side reset of ``sync_cache`` with ``os.register_at_fork``.
    Registrations can't be removed, so the hook holds a weak reference: a closed,
    dropped cache is collected, and its hook does nothing."""
    ref = weakref.ref(sync_cache)

    def after_in_child() -> None:
        alive = ref()
        if alive is not None:
            alive._forget_parent()

    os.register_at_fork(after_in_child=after_in_child)


class SyncLayeredCache:
    """Thread-safe blocking API over one ``LayeredCache`` running on a private loop."""

    def __init__(
        self,
        config: Config,
        *,
        max_workers: int = 32,
        max_overflow: int = 128,
        timeout: float | None = DEFAULT_TIMEOUT,
        **cache_kwargs: Any,
    ) -> None:
        """``max_workers``: threads kept for sync loaders; ``max_overflow``: loaders on
        threads of their own beyond them (``_sync_loaders``); ``timeout``: seconds a call
        may block before ``SyncTimeoutError`` (a ``TimeoutError``); None: no bound."""
        check_timeout(timeout)
        self.config = config
        self._inner = InnerCaches(config, cache_kwargs)
        self._timeout = timeout
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._runner: LoopThread | None = None
        self._cache: LayeredCache | None = None
        self._started = False  # start() called and close() not: a forked child rebuilds
        self._loaders = LoaderThreads(max_workers, max_overflow)
        _forget_parent_after_fork(self)

    @classmethod
    def from_config(cls, config: Config, **kwargs: Any) -> SyncLayeredCache:
        return cls(config, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> SyncLayeredCache:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the loop thread and the cache on it (idempotent)."""
        with self._lock:
            self._started = True
            self._start_locked()

    def _start_locked(self) -> LayeredCache:
        if self._runner is not None and self._cache is not None:
            return self._cache
        runner = LoopThread(self._max_workers)
        opening = self._inner.open(self)
        try:
            self._cache = runner.run(opening, self._timeout, "starting the cache")
        except BaseException:
            runner.stop()
            raise
        self._runner = runner
        return self._cache

    def close(self, timeout: float = 10.0) -> None:
        """Close the cache, stop the loop thread, shut the loader pool down."""
        with self._lock:
            self._started = False
            runner, cache = self._runner, self._cache
            self._runner = self._cache = None
            if runner is None:
                return
            if not runner.owned_here:  # close() in a forked child before any call
                runner.abandon(cache)
                return
            try:
                if cache is not None:
                    runner.cancel_calls()
                    with contextlib.suppress(SyncTimeoutError):
                        runner.run(cache.close(), timeout, "closing the cache")
            finally:
                runner.stop(timeout)  # whatever closing raised: no loop thread left behind

    def _forget_parent(self) -> None:
        """In a forked child (``os.register_at_fork``): the loop thread, the loader pool
        and the Redis connections are the parent's. Drop them untouched (the parent
        still uses those sockets) and a fresh lock (another thread may have held ours at
        the fork); the next call builds a new loop and a new cache, with an empty L1
        (the copied L1 missed every invalidation since the fork)."""
        if self._runner is not None:
            self._runner.abandon(self._cache)
        self._runner = self._cache = None
        self._lock = threading.Lock()
        self._loaders = self._loaders.fresh()

    @property
    def cache(self) -> LayeredCache:
        """The underlying async cache (for metrics registration, policies, stats).
        In a forked child, the first use builds the child's own (lazily)."""
        if (cache := self.running_cache()) is not None:
            return cache
        with self._lock:
            if not self._started:
                raise RuntimeError("SyncLayeredCache is not started (use `with` or .start())")
            if self._runner is not None and not self._runner.owned_here:
                self._forget_parent()  # a fork the at-fork hook did not see
            return self._start_locked()

    def running_cache(self) -> LayeredCache | None:
        """``cache`` if this process has built it, else None (not started, closed, a
        forked child before its first call): for a scrape, which must not build one."""
        cache, runner = self._cache, self._runner
        return cache if cache is not None and runner is not None and runner.owned_here else None

    @property
    def hooks(self) -> Hooks:
        """``cache.hooks``, also before it is built: kept by every inner cache built."""
        return self._inner.hooks

    # -- plumbing ----------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        runner = self._runner
        if runner is None or self._cache is None or not runner.owned_here:
            coro.close()
            raise RuntimeError("SyncLayeredCache is not started (use `with` or .start())")
        if threading.get_ident() == runner.thread.ident:
            coro.close()
            raise RuntimeError("SyncLayeredCache called from its own event loop thread")
        return runner.run(coro, self._timeout, what)

    def _call(self, make: Callable[[LayeredCache], Coroutine[Any, Any, T]], what: str) -> T:
        """Run ``make(cache)`` on the loop (for in-package adapters, e.g. Django's)."""
        _refuse_running_loop()
        return self._run(make(self.cache), what)

    # -- public API (same as LayeredCache, blocking) -----------------------------------

    def get_or_load(
        self,
        namespace: str,
        fields: Mapping[str, object],
        loader: Callable[[], T],
        tags: TagsOf | None = None,
    ) -> T:
        """The value from L1, else L2, else ``loader()`` (one load per key fleet-wide)."""
        _refuse_running_loop()
        _refuse_async(loader, "get_or_load")
        ns = self.cache.namespace(namespace)
        check_tags(ns.policy, tags)
        value = _l1_hit(ns.policy, fields)
        if value is not MISSING:
            return typing.cast(T, value)
        key = ns.policy.template.build(fields)
        self._loaders.check_not_own_key(key)
        load = self._loaders.wrap(key, loader, self._pool())
        if isinstance(loader, RequestBound):  # the mark survives the wrapping (no refresh)
            load = RequestBound(load, (), {})
        return self._run(
            self.cache.get_or_load(namespace, fields, load, tags), f"get_or_load({namespace!r})"
        )

    def get(self, namespace: str, fields: Mapping[str, object]) -> Any:
        """The cached value or None; never loads."""
        _refuse_running_loop()
        value = _l1_hit(self.cache.namespace(namespace).policy, fields)
        if value is not MISSING:
            return value
        return self._run(self.cache.get(namespace, fields), f"get({namespace!r})")

    def set(
        self,
        namespace: str,
        fields: Mapping[str, object],
        value: Any,
        tags: Iterable[str] | None = None,
    ) -> None:
        _refuse_running_loop()
        self._run(self.cache.set(namespace, fields, value, tags), f"set({namespace!r})")

    def get_many(self, namespace: str, fields_list: Sequence[Mapping[str, object]]) -> list[Any]:
        """Values in order, None for a miss (``LayeredCache.get_many``)."""
        _refuse_running_loop()
        return self._run(self.cache.get_many(namespace, fields_list), f"get_many({namespace!r})")

    def get_or_load_many(
        self,
        namespace: str,
        fields_list: Sequence[Mapping[str, object]],
        load_many: Callable[[list[Any]], Sequence[Any]],
        tags: TagsOf | None = None,
    ) -> list[Any]:
        """``LayeredCache.get_or_load_many`` with a sync ``load_many`` (on the pool)."""
        _refuse_running_loop()
        _refuse_async(load_many, "get_or_load_many")
        fields_list = list(fields_list)  # read once: the keys here, the call below
        key_of = self.cache.namespace(namespace).key
        for fields in fields_list:
            self._loaders.check_not_own_key(key_of(fields))
        load = self._loaders.wrap_many(key_of, load_many, self._pool())
        call = self.cache.get_or_load_many(namespace, fields_list, load, tags)
        return self._run(call, f"get_or_load_many({namespace!r})")

    def set_many(self, namespace: str, items: Sequence[tuple[Mapping[str, object], Any]]) -> None:
        _refuse_running_loop()
        self._run(self.cache.set_many(namespace, items), f"set_many({namespace!r})")

    def invalidate_tag(self, tag: str) -> None:
        """Kill every entry carrying ``tag`` everywhere (``LayeredCache.invalidate_tag``)."""
        _refuse_running_loop()
        self._run(self.cache.invalidate_tag(tag), f"invalidate_tag({tag!r})")

    def _pool(self) -> Executor | None:
        return self._runner.executor if self._runner is not None else None

    def invalidate(self, namespace: str, fields: Mapping[str, object]) -> None:
        """Delete the L2 key, replicas and lease, then drop L1 everywhere."""
        _refuse_running_loop()
        self._run(self.cache.invalidate(namespace, fields), f"invalidate({namespace!r})")

    def cached(
        self,
        namespace: str,
        *,
        value_type: Any = None,
        ignore: Iterable[str] = (),
        tags: TagsOf | None = None,
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorator for sync functions; key fields come from the call's arguments.

        The return annotation (or ``value_type``) becomes the namespace's value type
        (evaluated alone, at the first call if it names what does not exist yet).
        Every other parameter must be a key field, or named in ``ignore``. ``tags``: as
        ``get_or_load``'s."""
        ns = self.cache.namespace(namespace)  # an unknown namespace fails here, not at a call

        def declare(value_type: Any, by: str) -> None:  # at a first call: after a fork too
            self._inner.declare(self.cache.namespace(namespace), value_type, by)

        def decorate(fn: Callable[P, T]) -> Callable[P, T]:
            return cached_sync(ns, fn, value_type, ignore, tags, self.get_or_load, declare)

        return decorate

    def stats(self) -> dict[str, dict[str, int | dict[int, int]]]:
        return self.cache.stats()

    def redis_status(self) -> RedisStatus:
        return self.cache.redis_status()

    def hot_keys(self) -> dict[str, dict[str, float]]:
        return self.cache.hot_keys()

    def key(self, namespace: str, fields: Mapping[str, object]) -> str:
        return self.cache.key(namespace, fields)


def _l1_hit(policy: Policy, fields: Mapping[str, object]) -> Any:
    """The L1 value (counted as an L1 hit) or MISSING; validates the key either way."""
    key = policy.template.build(fields)
    l1 = policy.l1
    if l1 is None or not policy.cache:
        return MISSING
    value = l1.get(key)
    if value is not MISSING:
        policy.stats.l1_hit += 1
    return value


def _refuse_async(loader: Callable[..., Any], call: str) -> None:
    """An async function as a sync loader would return a coroutine object where a value
    is due: refused before anything runs (``_sync_loaders`` also refuses any awaitable a
    loader returns)."""
    if inspect.iscoroutinefunction(loader):
        raise TypeError(
            f"SyncLayeredCache.{call}() takes a plain function as loader, not the async "
            f"function {getattr(loader, '__qualname__', loader)!r}: use LayeredCache (the "
            "async API) for async loaders"
        )


def _refuse_running_loop() -> None:
    """Blocking inside a running event loop would freeze it for the whole call."""
    if asyncio.events._get_running_loop() is not None:
        raise RuntimeError(
            "SyncLayeredCache called from a running event loop (async code): it would "
            "block the loop; await the async API instead (layered_cache.LayeredCache, "
            "e.g. `await cache.get_or_load(...)`)"
        )
