"""HTTP caching of cached values, framework-neutral: the ``Cache-Control`` a namespace's
responses carry, a strong ``ETag`` per value version, and ``If-None-Match`` matching.

The ASGI helper (``layered_cache.asgi``) builds responses from these; any other
framework can too. Nothing here imports a web framework (docs/http.md).

Why the ETag is a digest of the value (as sent) and not of the envelope: L1 keeps
decoded values only (no ``written_at``), and a 304 must be answerable from L1. A digest
of the value's encoding is the same on every instance and after a reload that did not
change the value (the client keeps its copy: a 304, not a 200), and differs as soon as
any field does. The ASGI helper digests the rendered body with its media type
(``body_etag``): a strong ETag names one representation, so two renderings of one value
(JSON and HTML, or a deploy that changed ``render``) must not share one, or a client
keeps the other's body on a 304. The digest is computed once per fill, not per request
(``ETags``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from layered_cache._config import NamespaceConfig
from layered_cache._forklock import ForkSafeLock

__all__ = ["ETags", "body_etag", "cache_control", "matches", "strong_etag"]

_ENCODER = msgspec.msgpack.Encoder()


def cache_control(ns: NamespaceConfig) -> str:
    """The ``Cache-Control`` value for responses serving namespace ``ns``.

    Never cached (``cache = false``) or ``no_store``: ``no-store``. No ``http`` table:
    ``no-cache`` (anyone may store it but must revalidate with the ETag every time, so
    the default never serves a stale price). Otherwise the table's directives."""
    http = ns.http
    if not ns.cache or (http is not None and http.no_store):
        return "no-store"
    if http is None:
        return "no-cache"
    parts = ["private" if http.private else "public", f"max-age={int(http.max_age)}"]
    if http.s_maxage is not None:
        parts.append(f"s-maxage={int(http.s_maxage)}")
    if http.stale_while_revalidate is not None:
        parts.append(f"stale-while-revalidate={int(http.stale_while_revalidate)}")
    return ", ".join(parts)


def strong_etag(value: Any) -> str:
    """A strong ETag (quoted, no ``W/``) for ``value``: values that encode alike, equal
    tags. Strong is right because the body is a deterministic rendering of the value.
    Two equal dicts in another key order get different tags, on purpose: their JSON
    bodies differ too, and a strong tag must change with the bytes (RFC 9110 8.8.1)."""
    digest = hashlib.blake2b(_ENCODER.encode(value), digest_size=16).hexdigest()
    return f'"{digest}"'


def body_etag(body: bytes, media_type: str) -> str:
    """A strong ETag for one representation: ``body`` as sent, with its media type. What
    a hand-built response should use when it renders the value itself."""
    digest = hashlib.blake2b(media_type.encode() + b"\n" + body, digest_size=16).hexdigest()
    return f'"{digest}"'


def matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an ``If-None-Match`` header matches ``etag`` (RFC 9110 13.1.2: weak
    comparison, a list of tags or ``*``)."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == etag:
            return True
    return False


class ETags:
    """The ETag of each key's current value, computed once per value object.

    An L1 hit returns the very object L1 holds, so ``is`` identifies "the same fill"
    without hashing again; a new fill (another object) is hashed once. Bounded LRU: the
    memo holds at most ``max_entries`` values alive besides L1's. ``etag_of`` computes a
    new value's tag (``strong_etag``, or a digest of its rendered body)."""

    def __init__(
        self, max_entries: int = 10_000, etag_of: Callable[[Any], str] = strong_etag
    ) -> None:
        self._max = max_entries
        self._etag_of = etag_of
        self._memo: OrderedDict[str, tuple[Any, str]] = OrderedDict()
        # SyncLayeredCache users call from many threads; one may hold it at a fork.
        self._lock = ForkSafeLock()

    def of(self, key: str, value: Any) -> str:
        with self._lock:
            entry = self._memo.get(key)
            if entry is not None and entry[0] is value:
                self._memo.move_to_end(key)
                return entry[1]
        etag = self._etag_of(value)
        with self._lock:
            self._memo[key] = (value, etag)
            self._memo.move_to_end(key)
            while len(self._memo) > self._max:
                self._memo.popitem(last=False)
        return etag
