"""``LayeredCache``: the registry of namespaces plus the lifecycle of what they share.

Each namespace (``namespace.py``) owns its policy and read path; this class builds
them over one set of parts (``wiring.py``), starts and stops the background work
(backplane listener, fleet hot-key reports, refresh tasks), and offers the public API
keyed by namespace name. It owns no storage logic and no step of the read path.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import msgspec
import structlog

from layered_cache import _decorate as decorate
from layered_cache import _startup as startup
from layered_cache._backplane import BackplaneListener, BackplaneStatus
from layered_cache._batch import LoadMany
from layered_cache._coherence import Coherence
from layered_cache._config import Config
from layered_cache._fallback import FallbackSubscriber
from layered_cache._hits import HitPath
from layered_cache._invalidation import Invalidator
from layered_cache._miss import TagsOf
from layered_cache._namespace import Namespace
from layered_cache._policy import compile_policies
from layered_cache._purges import Purger, PurgeStats
from layered_cache._redisclock import redis_clock
from layered_cache._runtime import Hooks
from layered_cache._wiring import CacheParts, build_parts

__all__ = ["LayeredCache", "RedisStatus"]

T = TypeVar("T")
P = ParamSpec("P")

_log = structlog.get_logger("layered_cache")


class RedisStatus(msgspec.Struct, frozen=True):
    """The circuit breakers' view of Redis (``LayeredCache.redis_status()``)."""

    breaker: str  # "closed", "open" or "half-open": the shared breaker
    breaker_transitions: int
    node_breakers: dict[str, str]  # Redis Cluster: one breaker per master, by "host:port"


class LayeredCache(HitPath):
    """Async multi-layer cache. Use as ``async with LayeredCache.from_config(cfg) as c``."""

    def __init__(
        self,
        config: Config,
        parts: CacheParts,
        *,
        value_types: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
        purger: Purger | None = None,
        expiry_of: Mapping[str, Callable[[Any], float | None]] | None = None,
    ) -> None:
        policies = compile_policies(config)  # refused before anything is set up
        self.config = config
        self._parts = parts
        self._store = parts.store
        # ``clock`` is this host's wall clock; envelopes are stamped and judged in Redis'
        # time (``_redisclock``): a skewed host must not stretch or cut values' lives.
        self._clock = redis_clock(clock, parts.client, config)
        self._rt = startup.runtime(config, parts, self._clock.now, rand, purger)
        self._purger, self._closed = purger, False
        self._namespaces = {name: Namespace(policy, self._rt) for name, policy in policies.items()}
        self._coherence = Coherence(list(self._namespaces.values()), self._rt)
        for name, value_type in (value_types or {}).items():
            self.namespace(name)._declare_type(value_type, by="value_types")
        for name, own_expiry in (expiry_of or {}).items():
            self.namespace(name).policy.expiry_of = own_expiry
        self._built_in, self._started_in, self._starts = os.getpid(), 0, 0
        self._one_start = startup.OneAtATime()
        self._follow()
        _after_fork_in_child(self)

    def _follow(self) -> None:
        """Listener, fallback subscriber and hot-key reporter (built again by ``start``)."""
        config, parts = self.config, self._parts
        followers = startup.followers(parts, self._coherence, config, self._rt)
        self._backplane, self._fallback = followers
        detecting = any(ns.policy.hot is not None and ns.policy.hot.threshold for ns in self)
        hot_keys = self.hot_keys if detecting else None
        self._hot_reporter = startup.hot_key_reporter(parts, config.redis.prefix, hot_keys)

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        value_types: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
        purger: Purger | None = None,
        expiry_of: Mapping[str, Callable[[Any], float | None]] | None = None,
    ) -> LayeredCache:
        """The cache for ``config``, with Redis clients built from it (no I/O yet).
        ``value_types``: namespace -> the type its reads decode into. ``expiry_of``:
        namespace -> a value's own expiry, Redis time (``Policy.soft_expiry``)."""
        return cls(
            config, build_parts(config), value_types=value_types, clock=clock, rand=rand,
            purger=purger, expiry_of=expiry_of,
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> LayeredCache:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Follow the backplane, report hot keys; ``_startup`` says what is checked first."""
        async with self._one_start.turn():  # one overlapping it waits (``OneAtATime``)
            await _rebind(self)
            self._built_in, self._started_in, self._closed = os.getpid(), os.getpid(), False
            self._rt.refusal, self._rt.ended, self._starts = None, False, self._starts + 1
            try:
                await self._start_steps(self._starts)
            except BaseException:  # a mismatch, Redis down, our caller's deadline: undone
                await self.close()
                raise

    async def _start_steps(self, start: int) -> None:
        client = self._parts.client
        left = await startup.learn_slots(client, startup.start_wait(self.config.redis))
        self._still_starting(start)  # no followers left running on a cache closed meanwhile
        followers, unplaced = (self._backplane, self._fallback), startup.unplaced(self._backplane)
        # The clock, the replica check and the listener's position: one wait (``first_steps``).
        await startup.first_steps(self._clock, client, self, followers, self.config, left)
        self._still_starting(start)
        startup.positioned_now(unplaced, self._backplane, self._coherence)
        for check in startup.background_checks(self._parts.client, self.config):
            self._rt.tasks.spawn(check)
        if self._hot_reporter is not None:
            self._hot_reporter.start()

    def _still_starting(self, start: int) -> None:
        # A close() that ran while start() awaited Redis returned before start() resumed.
        if self._closed or start != self._starts:
            raise RuntimeError("close() ran while start() was starting this LayeredCache")

    async def close(self) -> None:
        """Followers first, then background work's grace (``BackgroundTasks.close``), then
        the clients; a caller's deadline cutting this short still cancels the rest
        (``_cancel_own_work``) and closes the clients. Calls are refused from here on,
        L1 dropped (``Runtime.check_open``); a start() waiting stops."""
        async with self._one_start.closing():  # a start() meanwhile waits for our end
            self._rt.refusal, self._closed = _CLOSED, True
            self._rt.leases.end_waits()  # reads waiting on a lease raise the closed error
            self._coherence.forget_all()  # now: L1 hits take no check (``_ended`` says why)
            try:
                if self._backplane is not None:
                    await self._backplane.stop()
                if self._fallback is not None:
                    await self._fallback.stop()
                if self._hot_reporter is not None:
                    await self._hot_reporter.stop()
                await self._rt.purges.close()  # what is queued gets a second to go out
                await self._clock.stop()
                await self._rt.tasks.close()
            finally:
                _ended(self)
                try:
                    await _cancel_own_work(self)
                finally:
                    await self._parts.close()

    # -- namespaces --------------------------------------------------------------------

    def namespace(self, name: str) -> Namespace:
        """The namespace ``name`` (its policy, stats and read path)."""
        try:
            return self._namespaces[name]
        except KeyError:
            raise KeyError(
                f"unknown namespace {name!r} (configured: {sorted(self._namespaces)})"
            ) from None

    def __iter__(self) -> Any:
        return iter(self._namespaces.values())

    @property
    def instance_id(self) -> str:
        """Names this process in backplane entries and fleet hot-key reports."""
        return self._parts.instance_id

    def key(self, namespace: str, fields: Mapping[str, object]) -> str:
        """The full Redis key for these fields (validated)."""
        return self.namespace(namespace).key(fields)

    # -- reads and writes --------------------------------------------------------------

    async def get_many(
        self, namespace: str, fields_list: Sequence[Mapping[str, object]]
    ) -> list[Any]:
        """Values in order, None for a miss: L1, then MGET (per master in a cluster)."""
        return await self.namespace(namespace).get_many(fields_list)

    async def get_or_load_many(
        self,
        namespace: str,
        fields_list: Sequence[Mapping[str, object]],
        load_many: LoadMany,
        tags: TagsOf | None = None,
    ) -> list[Any]:
        """Values in order: L1, else L2, else one ``load_many(missing)`` call, which
        returns one value per missing key, in order. Each missed key takes its lease
        (one round trip for the batch); single-flight holds across batches."""
        return await self.namespace(namespace).get_or_load_many(fields_list, load_many, tags)

    async def set_many(
        self, namespace: str, items: Sequence[tuple[Mapping[str, object], Any]]
    ) -> None:
        """``set`` for many keys: one MULTI/EXEC on a single node, one backplane append."""
        await self.namespace(namespace).set_many(items)

    async def set(
        self,
        namespace: str,
        fields: Mapping[str, object],
        value: Any,
        tags: Iterable[str] | None = None,
    ) -> None:
        """Write L2 (base and replicas) and this instance's L1; other instances drop
        their L1 copy. Raises ``L2Unavailable`` if Redis fails (see ``Namespace.set``)."""
        await self.namespace(namespace).set(fields, value, tags)

    async def invalidate(self, namespace: str, fields: Mapping[str, object]) -> None:
        """Delete the L2 key, every replica and the lease; then drop L1 everywhere.
        Raises ``L2Unavailable`` if Redis can't be reached (the local L1 copy is dropped
        regardless)."""
        await self._coherence.invalidate(self.namespace(namespace), fields)

    async def invalidate_tag(self, tag: str) -> None:
        """Kill every entry carrying ``tag``, in L2, replicas and every instance's L1, in
        a bounded number of round trips whatever their number (``_tags``). Raises
        ``L2Unavailable`` if Redis can't be reached (local copies are dropped regardless)."""
        await self._coherence.invalidate_tag(tag)

    def cached(
        self,
        namespace: str,
        *,
        value_type: Any = None,
        ignore: Iterable[str] = (),
        tags: TagsOf | None = None,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
        """Decorator: cache an async function; key fields come from its arguments.

        The return annotation (or ``value_type``) declares the namespace's value type,
        so L2 hits decode into it; a namespace has one type (a different one raises).
        Only the return annotation is evaluated: at the first call if it names what
        does not exist yet (a classmethod's own class).
        Every other parameter must be a key field, or named in ``ignore`` (it never
        changes the value: a database session). ``tags``: as ``get_or_load``'s."""
        ns = self.namespace(namespace)  # an unknown namespace fails here, not at a call

        def decorator(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
            return decorate.cached(ns, fn, value_type, ignore, tags)

        return decorator

    # -- observation -------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, int | dict[int, int]]]:
        """Counters per namespace (l1_hit, l2_hit, miss, load, coalesced, ...)."""
        return {ns.name: ns.stats() for ns in self}

    def redis_status(self) -> RedisStatus:
        breaker, nodes = self._store.breaker, sorted(self._store.node_breakers.items())
        return RedisStatus(breaker.state, breaker.transitions, {n: b.state for n, b in nodes})

    def backplane_status(self) -> BackplaneStatus | None:
        """The backplane listener's state and counters; None when the backplane is off."""
        if self._backplane is None:
            return None
        return _backplane_status(self._backplane, self._fallback, self._rt.invalidator)

    def purge_stats(self) -> PurgeStats:  # HTTP purges (``purger``, docs/http.md)
        return self._rt.purges.stats

    def hot_keys(self) -> dict[str, dict[str, float]]:
        """Current hot keys per namespace with their measured L2 read rate (reads/s)."""
        return {ns.name: ns.hot_keys() for ns in self if ns.policy.hot is not None}

    @property
    def hooks(self) -> Hooks:
        """Instrumentation (``prometheus``, ``tracing``): load/L2-read observers, load wrapper."""
        return self._rt.hooks


_CLOSED = "this LayeredCache is closed: start() it again, or build a new one"


def _after_fork_in_child(cache: LayeredCache) -> None:
    """Register ``cache._after_fork`` with ``os.register_at_fork``. Registrations can't
    be removed, so the hook holds a weak reference: a dropped cache is collected."""
    ref = weakref.ref(cache)

    def after_in_child() -> None:
        alive = ref()
        if alive is not None:
            _forget_parent(alive)

    os.register_at_fork(after_in_child=after_in_child)


async def _rebind(cache: LayeredCache) -> None:
    """What ``start`` makes anew first. In a process forked after construction
    (gunicorn ``--preload``), ``startup.forked``. Connections made on another event loop
    (calls before ``start()``: a warm-up at import under ``asyncio.run``; a start whose
    loop ended without ``close()``) or by the parent are closed: reused here they failed
    ("Event loop is closed"), or talked on the parent's sockets. Then a closed cache is
    reopened (``startup.reopened``): a second lifespan, a new loop, a new ``TestClient``.
    Calls before a start on their own loop (a lifespan's) keep their connections, not
    their L1 (``startup.positioned_now``)."""
    forked = os.getpid() != cache._built_in
    if forked:
        startup.forked(cache._parts, cache._started_in)
    loop, used_on = asyncio.get_running_loop(), cache._rt.loop
    moved = cache._rt.other_loop or (used_on is not None and used_on is not loop)
    if not cache._closed and (forked or moved):
        await cache._parts.close()
        cache._closed = True
    if cache._closed:
        startup.reopened(cache._parts, cache._rt, cache._coherence, cache.config, cache._purger)
        cache._follow()
    cache._rt.loop, cache._rt.other_loop = loop, False


def _ended(cache: LayeredCache) -> None:
    """What ``close`` does whatever cut it short, before the clients close."""
    cache._started_in = 0  # nothing left to a fork; start reopens (``_closed``)
    # No listener keeps L1 coherent any more. Also as close() begins, not only after its
    # grace (seconds), as an L1 hit takes no check; fills begun before are refused then.
    cache._coherence.forget_all()
    cache._rt.ended = True  # a call in flight stores nothing from here on (``_miss``)


async def _cancel_own_work(cache: LayeredCache) -> None:
    """What a ``close()`` cut short by its caller's deadline left running (nothing once
    it ran to its end): followers, the clock's sampler, background tasks. Cancelled
    before the clients close, which each would reopen: the hot-key reporter writing its
    report every second, a fill writing L2 on a connection nobody closed."""
    # The backplane listener's ``stop``, close()'s first step, cancels it before its
    # first await: a close() that ran at all did.
    for follower in (cache._fallback, cache._hot_reporter):
        if follower is not None:
            follower.cancel()
    cache._clock.cancel()
    await cache._rt.tasks.cancel_all()


def _forget_parent(cache: LayeredCache) -> None:
    """In a child forked from this process: L1 and the tag versions are a copy that
    missed every invalidation since the fork. A cache this process started holds its
    connections and tasks: refused in the child (``start`` says so too), as every call
    would talk on the parent's sockets (the parent then read the child's reply as its
    own: another key's value)."""
    for ns in cache:
        if ns.policy.l1 is not None:
            ns.policy.l1.after_fork()
    cache._rt.flight.forget_all()  # loads of the parent's, on its event loop
    cache._rt.versions.forget_all()
    if cache._started_in and not cache._closed:
        cache._rt.refusal = startup.started_elsewhere(cache._started_in)


def _backplane_status(
    backplane: BackplaneListener, fallback: FallbackSubscriber | None, invalidator: Invalidator
) -> BackplaneStatus:
    """The listener's status with the pub/sub fallback's counters added."""
    status = backplane.status()
    return msgspec.structs.replace(
        status,
        fallback_sent=invalidator.fallback_deliveries,
        fallback_received=fallback.received if fallback is not None else 0,
        errors=status.errors + (fallback.errors if fallback is not None else 0),
        gaps=status.gaps + (fallback.clears if fallback is not None else 0),
    )
