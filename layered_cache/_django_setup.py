"""What ``layered_cache.django`` builds from Django's ``CACHES`` entry, how it writes an
entry (``write``: timeout 0 and oversized values delete; ``clear()`` is
``_django_clear``). An entry's timeout reaches Redis in the write itself
(``expiry_of``, ``Policy.soft_expiry``).

Django makes one backend object per alias *per thread* (``caches`` is thread-local),
and calls ``close()`` on every one after each request. A loop thread and a Redis pool
per backend object would multiply with the threads and be torn down per request, so
backend objects share one ``SyncLayeredCache`` per configuration per process (``shared``);
it is never closed by Django (it dies with the process, and a fork rebuilds it).
"""

from __future__ import annotations

import json
import os
import threading
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from layered_cache._cache import LayeredCache
from layered_cache._config import Config, ConfigError, parse_config
from layered_cache._django_values import Entry
from layered_cache._loopthread import check_timeout
from layered_cache._policy import Policy
from layered_cache._sync_loaders import check_limits
from layered_cache._templates import parse_template
from layered_cache.sync import DEFAULT_TIMEOUT, SyncLayeredCache, _refuse_running_loop

__all__ = [
    "DEFAULT_NAMESPACE",
    "build_config",
    "close_shared",
    "shared",
    "write",
]

DEFAULT_NAMESPACE = "django"


def default_table(namespace: str) -> dict[str, Any]:
    """The namespace added when the config has none of that name: ``{namespace}:{key}``.
    L2 keeps an entry as long as the config allows (3650d, no jitter: a Django timeout is
    the caller's, exact); each write then sets the Redis TTL to the entry's own timeout.
    L1 keeps a copy about 5 s (every read checks the entry's own expiry too)."""
    return {
        "key": f"{namespace}:{{key}}",
        "l1": {"ttl": "5s", "jitter": 0.2},
        "l2": {"ttl": "3650d", "jitter": 0.0},
    }


def _with_defaults(namespace: str, declared: Any) -> Any:
    """The Django namespace as declared, ``default_table`` filling what it leaves out.
    Declared for its L1 size alone, it got the schema's ``l2`` (600 s, 10 % jitter), and
    a ``timeout=None`` entry died after ~10 minutes; ``l2 = true`` means the same."""
    if declared is None:
        return default_table(namespace)
    if not isinstance(declared, Mapping):
        return declared  # parse_config says what is wrong with it
    table = _merge(default_table(namespace), declared)
    if table["l2"] is True:
        table["l2"] = default_table(namespace)["l2"]
    return table


# Ours, plus Django's generic ones that a Redis-backed cache leaves to Redis (eviction is
# Redis's maxmemory policy; L1 has the namespace's max_entries): accepted, unused.
_OPTIONS = {
    "config",
    "namespace",
    "timeout",
    "max_workers",
    "max_overflow",
    "MAX_ENTRIES",
    "CULL_FREQUENCY",
}
_shared: dict[str, tuple[SyncLayeredCache, str]] = {}
_shared_lock = threading.Lock()
_log = structlog.get_logger("layered_cache")


def _reset_lock_in_child() -> None:
    """A thread of the parent may have held the lock at the fork; none runs here."""
    global _shared_lock
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` table by table (inline OPTIONS refine the file)."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_config(location: str, options: Mapping[str, Any]) -> tuple[Config, str]:
    """The layered_cache config of a ``CACHES`` entry, and the namespace it uses:
    ``LOCATION`` (a TOML file, may be empty) with ``OPTIONS["config"]`` merged over it,
    plus the namespace ``OPTIONS["namespace"]`` (default ``django``) if it lacks one, or
    the backend's defaults under a declared one (``_with_defaults``)."""
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ConfigError(f"CACHES OPTIONS: unknown {sorted(unknown)} (known: {sorted(_OPTIONS)})")
    raw: dict[str, Any] = {}
    source = "<CACHES OPTIONS>"
    if location:
        source = location
        try:
            raw = tomllib.loads(Path(location).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{location}: cannot read the layered_cache config: {exc}") from None
    raw = _merge(raw, options.get("config") or {})
    namespace = str(options.get("namespace", DEFAULT_NAMESPACE))
    namespaces = dict(raw.get("namespaces") or {})
    namespaces[namespace] = _with_defaults(namespace, namespaces.get(namespace))
    raw["namespaces"] = namespaces
    config = parse_config(raw, source=source)
    _check_namespace(config, namespace, source)
    return config, namespace


def _check_namespace(config: Config, namespace: str, source: str) -> None:
    """Refuse what Django's API can't be honoured on. ``add``/``incr``/``touch`` are
    atomic only as a step on the key in Redis under its lock (``_django_locked``): a
    namespace without L2 (``l2 = false``, ``cache = false``) has nothing there to read,
    so every ``add`` returned True and overwrote, an ``add``-based lock admitting all."""
    declared = config.namespaces[namespace]
    off = "l2 = false" if declared.l2 is False else "cache = false" if not declared.cache else ""
    if off:
        raise ConfigError(
            f"{source}: namespaces.{namespace}.{off.split()[0]}: a Django cache namespace "
            f"needs L2 (Redis), got {off}: add/incr/decr/touch are atomic only on the key "
            "in Redis (declare another namespace for process-local values)"
        )
    fields = parse_template(namespace, declared.key)[1]
    if len(fields) != 1:
        raise ConfigError(
            f"{source}: namespaces.{namespace}.key: a Django cache namespace has exactly one "
            f"placeholder (e.g. 'django:{{key}}'), got {list(fields)}"
        )


def shared(
    location: str, options: Mapping[str, Any], value_type: Any
) -> tuple[SyncLayeredCache, str]:
    """The process's ``SyncLayeredCache`` for this configuration (started on first use);
    the namespace's reads decode into ``value_type``. Refused inside a running event
    loop before anything is built: starting connects to Redis, which from an async view
    froze the loop (seconds, Redis hung) before the sync call's own refusal ran."""
    _refuse_running_loop()
    identity = json.dumps([location, dict(options)], sort_keys=True, default=repr)
    with _shared_lock:
        found = _shared.get(identity)
        if found is None:
            config, namespace = build_config(location, options)
            sync_cache = SyncLayeredCache.from_config(
                config,
                **_sync_options(options),
                value_types={namespace: value_type},
                # An entry's Django timeout is its expiry in Redis too, set in the write
                # itself (``Policy.soft_expiry``): no PEXPIRE to race another writer.
                expiry_of={namespace: _own_expiry},
            )
            sync_cache.start()
            found = _shared[identity] = (sync_cache, namespace)
    return found


def _sync_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SyncLayeredCache`` arguments in OPTIONS, refused as config is: a
    ``ConfigError`` naming ``<CACHES OPTIONS>`` and the option, where a string timeout
    (from an env var) failed every call with a TypeError, and 0 every call with
    "starting the cache did not finish within 0 s"."""
    found = {
        "timeout": options.get("timeout", DEFAULT_TIMEOUT),
        "max_workers": options.get("max_workers", 32),
        "max_overflow": options.get("max_overflow", 128),
    }
    try:
        check_timeout(found["timeout"])
        check_limits(found["max_workers"], found["max_overflow"])
    except ValueError as exc:
        raise ConfigError(f"<CACHES OPTIONS>: {exc}") from None
    return found


def close_shared() -> None:
    """Close every shared cache of this process (tests; a process that wants a clean
    exit). Backend objects made later start a new one."""
    with _shared_lock:
        found = list(_shared.values())
        _shared.clear()
    for sync_cache, _ in found:
        sync_cache.close()


async def write(
    cache: LayeredCache, namespace: str, fields: Mapping[str, str], entry: Entry
) -> bool:
    """Write one Django entry; whether it was stored. An already expired one (timeout 0)
    deletes the key; so does one too large for the namespace (``max_value_bytes``), as
    memcached does: the value it replaces must not be served on."""
    remaining = None if entry.expires_at is None else entry.expires_at - cache._rt.clock()
    policy = cache.namespace(namespace).policy
    if remaining is not None and remaining <= 0:
        await cache.invalidate(namespace, fields)
        return True  # stored as Django means it: gone at once
    if _too_large(policy, entry):
        policy.stats.not_cached += 1
        _log.warning("value_too_large", namespace=namespace, limit=policy.max_value_bytes)
        await cache.invalidate(namespace, fields)
        return False
    await cache.set(namespace, fields, entry)  # Redis drops it at its timeout (shared())
    return True


def _own_expiry(entry: Entry) -> float | None:
    return entry.expires_at


def _too_large(policy: Policy, entry: Entry) -> bool:
    if len(entry.payload) + 128 <= policy.max_value_bytes:
        return False  # far from the limit: no need to build the envelope
    # The exact size L2 would get (msgpack floats are 8 bytes whatever their value).
    return len(policy.codec.encode(entry, 0.0, 0.0, 0.0)) > policy.max_value_bytes

