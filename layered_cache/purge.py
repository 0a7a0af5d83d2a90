"""Purge on change: drop HTTP caches' copies after an invalidation (docs/http.md).

``Purger`` is the protocol: ``LayeredCache(..., purger=...)`` and the daemon call it,
through a bounded background queue, after ``invalidate()``, ``invalidate_tag()``,
``set()`` and every committed event. ``VarnishPurger`` is the real one (the ``http``
extra: httpx); it is what ``[purge] urls`` in the config builds.

Varnish is told by cache key and by tag, not by URL: responses from
``layered_cache.asgi`` carry ``X-Cache-Key`` and ``X-Cache-Tags``, which Varnish keeps
with the object, so one key served under several URLs (query strings, ``Accept``
variants) is purged at once and a tag reaches every page carrying it:

- ``PURGE /`` with ``X-Cache-Key: <key>`` -> ``ban obj.http.X-Cache-Key == <key>``
- ``BAN /`` with ``X-Cache-Tag: <tag>`` -> ``ban obj.http.X-Cache-Tags ~ ,<tag>,``

(the VCL is in docs/http.md and deploy/varnish/default.vcl).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from layered_cache._purges import Purger, PurgeStats

__all__ = ["KEY_REQUEST_HEADER", "TAG_REQUEST_HEADER", "PurgeStats", "Purger", "VarnishPurger"]

KEY_REQUEST_HEADER = "X-Cache-Key"
TAG_REQUEST_HEADER = "X-Cache-Tag"
_PARALLEL = 16  # requests in flight per purge, so a 1,000-key batch is not 1,000 RTTs


class VarnishPurger:
    """``PURGE`` per key and ``BAN`` per tag, to every Varnish in ``urls``. Any answer
    but 2xx is a failure (the queue retries the whole purge: bans are idempotent)."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 2.0, client: Any = None) -> None:
        try:
            import httpx
        except ImportError:  # pragma: no cover - depends on the installed extras
            raise ImportError(
                "VarnishPurger needs httpx: pip install 'layered_cache[http]'"
            ) from None
        self.urls = [url.rstrip("/") + "/" for url in urls]
        self._timeout = timeout
        self._client = client or httpx.AsyncClient(timeout=timeout)
        self._owns_client = client is None
        self._slots = asyncio.Semaphore(_PARALLEL)

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        requests = [("PURGE", url, {KEY_REQUEST_HEADER: key}) for url in self.urls for key in keys]
        requests += [("BAN", url, {TAG_REQUEST_HEADER: tag}) for url in self.urls for tag in tags]
        results = await asyncio.gather(*(self._send(*r) for r in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _send(self, method: str, url: str, headers: dict[str, str]) -> None:
        async with self._slots:
            # ``timeout`` bounds the whole request: httpx's own bounds each read, so a
            # gateway trickling its answer a byte at a time held every later purge.
            async with asyncio.timeout(self._timeout):
                reply = await self._client.request(method, url, headers=headers)
        if not 200 <= reply.status_code < 300:
            # Method, URL and status only: the headers hold the key or tag, and this text
            # is logged (``http_purge_failed``), where ``redact_keys`` must find no key.
            raise RuntimeError(f"{method} {url}: HTTP {reply.status_code}")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
