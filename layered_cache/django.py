"""A Django cache backend over layered_cache: L1 in each process, L2 in Redis, the
backplane keeping every process's L1 coherent, and stampede protection on
``get_or_set``. Needs the ``django`` extra. Documented in docs/django.md::

    CACHES = {
        "default": {
            "BACKEND": "layered_cache.django.LayeredCacheBackend",
            "LOCATION": "/etc/shop/layered_cache.toml",   # optional: a layered_cache config
            "OPTIONS": {
                "config": {"redis": {"url": "redis://cache:6379/0", "prefix": "shop:"}},
                "namespace": "django",                     # default; added if missing
            },
        }
    }

Django keys become one key field of that namespace (``_django_keys``: readable when
they can be, hashed otherwise, injective either way); values are stored without pickle
(``_django_values``) with their own expiry, so ``timeout`` is exact in every layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

try:
    from django.core.cache.backends.base import DEFAULT_TIMEOUT, BaseCache
    from django.db import close_old_connections, connections
except ImportError as error:  # pragma: no cover - exercised without the extra
    from layered_cache._extras import missing_extra

    raise missing_extra("layered_cache.django", "django", error) from error

from layered_cache._cache import LayeredCache
from layered_cache._django_async import AsyncMethods
from layered_cache._django_clear import clear_namespace
from layered_cache._django_keys import field_value
from layered_cache._django_locked import alive as _alive
from layered_cache._django_locked import locked
from layered_cache._django_setup import shared, write
from layered_cache._django_values import (
    Entry,
    UncacheableValue,
    UndecodableValue,
    dumps,
    loads,
    readable,
)
from layered_cache._logs import error_text
from layered_cache._templates import parse_template
from layered_cache.sync import SyncLayeredCache

__all__ = ["LayeredCacheBackend", "UncacheableValue"]

_log = structlog.get_logger("layered_cache.django")
_UNDECODABLE = object()  # ``_value``'s answer for a payload it can't read


def _called(default: Any) -> Any:
    return default() if callable(default) else default


def _on_loader_thread(default: Any) -> Any:
    """``default`` (called if callable) on a loader thread: around it, Django's
    connection upkeep a request gets (``close_old_connections``), or a connection it
    opens there outlives CONN_MAX_AGE and, once the database drops it, fails every
    later default that thread runs."""
    _tidy_connections()
    try:
        return _called(default)
    finally:
        _tidy_connections()


def _tidy_connections() -> None:
    """Django's ``close_old_connections`` for this thread, unless one of its connections
    is inside a transaction (a default that runs get_or_set itself, in ``atomic()``):
    closing it there would end that transaction."""
    if not any(conn.in_atomic_block for conn in connections.all(initialized_only=True)):
        close_old_connections()

Fields = dict[str, str]


class LayeredCacheBackend(AsyncMethods, BaseCache):
    """``django.core.cache`` API over one layered_cache namespace (docs/django.md); its
    async methods are its sync ones on ``sync_to_async`` (``_django_async``)."""

    def __init__(self, location: str, params: dict[str, Any]) -> None:
        super().__init__(params)
        self._location = location or ""
        self._options: dict[str, Any] = dict(params.get("OPTIONS") or {})
        self._shared: tuple[SyncLayeredCache, str] | None = None  # connected on first use
        self._field = ""  # the namespace template's one placeholder

    @property
    def layered(self) -> SyncLayeredCache:
        """The process's ``SyncLayeredCache`` behind this backend: its other namespaces
        (``get_or_load("book", ...)``, event invalidation), ``stats()``, ``cache``."""
        return self._parts()[0]

    def _parts(self) -> tuple[SyncLayeredCache, str]:
        if self._shared is None:
            sync_cache, namespace = shared(self._location, self._options, Entry)
            template = sync_cache.config.namespaces[namespace].key
            self._field = parse_template(namespace, template)[1][0]
            self._shared = sync_cache, namespace
        return self._shared

    def key_fields(self, key: Any, version: int | None = None) -> Fields:
        """The namespace's key fields for a Django key, e.g. ``{"key": "/1/answer"}``:
        what a ``CacheInvalidate`` event (or ``layered.invalidate``) names it by."""
        return self._fields(key, version)

    def _fields(self, key: Any, version: int | None) -> Fields:
        self._parts()
        return {self._field: field_value(self.make_and_validate_key(key, version=version))}

    def _call(self, make: Callable[[LayeredCache, str], Any], what: str) -> Any:
        sync_cache, namespace = self._parts()

        async def run(cache: LayeredCache) -> Any:
            return await make(cache, namespace)

        return sync_cache._call(run, f"django {what}")

    def _entry(self, fields: Fields) -> Entry | None:
        sync_cache, namespace = self._parts()
        entry: Entry | None = sync_cache.get(namespace, fields)
        if entry is None or entry.expires_at is None:
            return entry
        # ``get`` just ran through ``sync_cache.cache`` (this process's cache, rebuilt
        # after a fork), so ``_cache`` is current: read its clock without a second check.
        cache = sync_cache._cache or sync_cache.cache
        return entry if entry.expires_at > cache._rt.clock() else None

    def _now(self) -> float:
        """The cache's clock: Redis' time as this host estimates it (``_redisclock``),
        so a Django timeout means the same instant on every host, whatever its skew."""
        shared = self._shared or self._parts()  # the get path: no second lookup
        return shared[0].cache._rt.clock()

    def get_backend_timeout(self, timeout: Any = DEFAULT_TIMEOUT) -> float | None:
        """Django's absolute expiry (``BaseCache.get_backend_timeout``), in Redis' time
        instead of this host's ``time.time()``."""
        return self._expires_at(timeout, self._now())

    def _expires_at(self, timeout: Any, now: float) -> float | None:
        """``timeout`` as an absolute expiry, counted from ``now`` (Redis' time)."""
        if timeout is DEFAULT_TIMEOUT:
            timeout = self.default_timeout
        elif timeout == 0:
            timeout = -1  # Django's ticket 21147: expired, whatever the float rounding
        return None if timeout is None else now + timeout

    # -- the django.core.cache API -----------------------------------------------------

    def get(self, key: Any, default: Any = None, version: int | None = None) -> Any:
        entry = self._entry(self._fields(key, version))
        value = _UNDECODABLE if entry is None else _value(entry, *self._parts())
        return default if value is _UNDECODABLE else value

    def set(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> None:
        entry = Entry(dumps(value), self.get_backend_timeout(timeout))
        fields = self._fields(key, version)
        self._call(lambda cache, ns: write(cache, ns, fields, entry), "set")

    def add(
        self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> bool:
        """Set unless present: one of any number of concurrent adders, in any process,
        gets True (under the key's lock and lease, ``_django_locked``). The timeout counts
        from when they are held: stamped before a wait for them (up to lease_ttl + 1 s), the
        entry was past its expiry when written, so deleted, and add still said True."""
        payload = dumps(value)  # UncacheableValue before anything is written
        fields = self._fields(key, version)

        async def add(cache: LayeredCache, namespace: str) -> bool:
            async def step(current: Entry | None) -> bool:
                if current is not None and readable(current.payload):
                    return False  # an unreadable payload is a miss: replaced
                entry = Entry(payload, self._expires_at(timeout, cache._rt.clock()))
                # False for a value too large to store: nothing was added, and an add()
                # used as a lock must not admit the next caller too.
                return await write(cache, namespace, fields, entry)

            return await locked(cache, namespace, fields, step)

        return bool(self._call(add, "add"))

    def touch(self, key: Any, timeout: Any = DEFAULT_TIMEOUT, version: int | None = None) -> bool:
        """A new expiry, ``timeout`` from when the key's lock is held (as ``add``)."""
        fields = self._fields(key, version)

        async def touch(cache: LayeredCache, namespace: str) -> bool:
            async def step(current: Entry | None) -> bool:
                if current is None or not readable(current.payload):
                    return False
                expires_at = self._expires_at(timeout, cache._rt.clock())
                await write(cache, namespace, fields, Entry(current.payload, expires_at))
                return True

            return await locked(cache, namespace, fields, step)

        return bool(self._call(touch, "touch"))

    def delete(self, key: Any, version: int | None = None) -> bool:
        fields = self._fields(key, version)

        async def delete(cache: LayeredCache, namespace: str) -> bool:
            existed = _alive(await cache.get(namespace, fields), cache._rt.clock())
            await cache.invalidate(namespace, fields)  # L2, replicas, lease, every L1
            return existed

        return bool(self._call(delete, "delete"))

    def has_key(self, key: Any, version: int | None = None) -> bool:
        entry = self._entry(self._fields(key, version))
        return entry is not None and readable(entry.payload)

    def incr(self, key: Any, delta: int = 1, version: int | None = None) -> Any:
        """Add ``delta``, keeping the remaining timeout. Atomic with every other
        add/incr/decr/touch of the key, in any process (``_django_locked``)."""
        fields = self._fields(key, version)

        async def incr(cache: LayeredCache, namespace: str) -> Any:
            async def step(current: Entry | None) -> Any:
                if current is None:
                    raise ValueError(f"Key '{key}' not found")
                try:
                    value = loads(current.payload) + delta
                except UndecodableValue as exc:
                    unreadable = f"Key '{key}' holds a value that can't be read: {exc}"
                    raise ValueError(unreadable) from exc
                await write(cache, namespace, fields, Entry(dumps(value), current.expires_at))
                return value

            return await locked(cache, namespace, fields, step)

        return self._call(incr, "incr")

    def get_many(self, keys: Iterable[Any], version: int | None = None) -> dict[Any, Any]:
        wanted = [(key, self._fields(key, version)) for key in keys]

        async def get_all(cache: LayeredCache, namespace: str) -> list[Any]:
            # one batch: L1 hits, then one MGET for the rest (LayeredCache.get_many)
            return await cache.get_many(namespace, [fields for _, fields in wanted])

        entries = self._call(get_all, "get_many")
        now, parts = self._now(), self._parts()
        values = {
            key: _value(entry, *parts)
            for (key, _), entry in zip(wanted, entries, strict=True)
            if _alive(entry, now)
        }
        return {key: value for key, value in values.items() if value is not _UNDECODABLE}

    def set_many(
        self, data: Mapping[Any, Any], timeout: Any = DEFAULT_TIMEOUT, version: int | None = None
    ) -> list[Any]:
        expires_at = self.get_backend_timeout(timeout)
        writes = [
            (self._fields(key, version), Entry(dumps(value), expires_at))
            for key, value in data.items()
        ]  # every value encoded before the first write: an uncacheable one writes none

        async def set_all(cache: LayeredCache, namespace: str) -> list[bool]:
            return await asyncio.gather(*(write(cache, namespace, f, e) for f, e in writes))

        if not writes:
            return []
        stored: list[bool] = self._call(set_all, "set_many")
        # Django: the keys that failed to insert (here: too large for max_value_bytes).
        return [key for key, ok in zip(data, stored, strict=True) if not ok]

    def delete_many(self, keys: Iterable[Any], version: int | None = None) -> None:
        targets = [self._fields(key, version) for key in keys]

        async def delete_all(cache: LayeredCache, namespace: str) -> None:
            await asyncio.gather(*(cache.invalidate(namespace, fields) for fields in targets))

        if targets:
            self._call(delete_all, "delete_many")

    def get_or_set(
        self,
        key: Any,
        default: Any,
        timeout: Any = DEFAULT_TIMEOUT,
        version: int | None = None,
    ) -> Any:
        """The cached value, else ``default`` (called if callable) stored and returned,
        one call of ``default`` per key for the fleet. As Django's: a present value wins
        whatever ``timeout`` says (0: a miss returns ``default`` unstored), the timeout
        counts from after ``default`` ran, a present value is never replaced or deleted."""
        sync_cache, namespace = self._parts()
        fields = self._fields(key, version)
        expires_at = self.get_backend_timeout(timeout)
        if expires_at is not None and expires_at <= self._now():  # timeout 0: not stored
            found = self.get(key, _UNDECODABLE, version)
            return _called(default) if found is _UNDECODABLE else found
        loaded: list[Any] = []

        def load() -> Entry:
            loaded.append(_on_loader_thread(default))
            return Entry(dumps(loaded[-1]), self.get_backend_timeout(timeout))  # stamped now

        entry: Entry = sync_cache.get_or_load(namespace, fields, load)
        if loaded:  # this call's default ran: its value (stored unless a write overtook it)
            return loaded[-1]
        value = _value(entry, sync_cache, namespace) if _alive(entry, self._now()) else _UNDECODABLE
        if value is not _UNDECODABLE:
            return value
        # A hit past its own timeout, or unreadable: Django's get_or_set, an add() that
        # never replaces what another process stored meanwhile, then that value.
        fresh = _called(default)  # the caller's thread: its connections are its request's
        self.add(key, fresh, timeout, version)
        found = self.get(key, _UNDECODABLE, version)
        return fresh if found is _UNDECODABLE else found

    def clear(self) -> None:
        """Invalidate every key of the namespace: all KEY_PREFIXes and versions sharing
        it, never another namespace's keys, never FLUSHDB (docs/django.md, the API). In
        steps, each bounded by OPTIONS["timeout"], not the whole (``_django_clear``)."""
        clear_namespace(self._call, self._parts()[0]._timeout)

    def close(self, **kwargs: Any) -> None:
        """Nothing to close per request: the loop and the Redis pool are shared by the
        process's backend objects (Django calls this after every request)."""


def _value(entry: Entry, sync_cache: SyncLayeredCache, namespace: str) -> Any:
    """``entry``'s value, or ``_UNDECODABLE`` for a payload this backend can't read
    (planted in Redis, or written by a version with more types): counted as the
    namespace's ``decode_error``, logged, and read as a miss, which the next set
    repairs. Raising instead failed every request reading the key until it expired,
    ``get_or_set`` included."""
    try:
        return loads(entry.payload)
    except UndecodableValue as exc:
        cache = sync_cache._cache or sync_cache.cache
        cache.namespace(namespace).policy.stats.decode_error += 1
        _log.warning("django_value_undecodable", namespace=namespace, error=error_text(exc))
        return _UNDECODABLE
