"""Starlette / FastAPI responses for cached values: ``Cache-Control`` from the
namespace's ``http`` policy, a strong ``ETag``, and ``304 Not Modified`` for a matching
``If-None-Match`` (docs/http.md).

Needs Starlette (FastAPI's responses are Starlette's); the rest of the library does not
import this module, so it stays free of a web framework.

    responses = CachedResponses(cache)

    @app.get("/books/{id}")
    async def get_book(id: int, request: Request) -> Response:
        return await responses.respond(request, "book", {"id": id}, lambda: db.book(id))

A hit in L1 or L2 never runs the loader; a 304 never renders the body. Each response
names its cache key (``X-Cache-Key``) and tags (``X-Cache-Tags``), which the gateway
stores with the object so a purge (``layered_cache.purge``) finds it; strip them in the
gateway before they reach clients if they should not be seen.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from layered_cache._cache import LayeredCache
from layered_cache._miss import TagsOf
from layered_cache._namespace import check_tags
from layered_cache._tag_args import tag_names
from layered_cache.http import ETags, body_etag, cache_control, matches

__all__ = ["KEY_HEADER", "TAGS_HEADER", "CachedResponses"]

KEY_HEADER = "X-Cache-Key"
TAGS_HEADER = "X-Cache-Tags"  # ",tag1,tag2,": commas at both ends so a ban regex can
# match one whole tag as ",book:42," (docs/http.md)


class CachedResponses:
    """Builds the HTTP response for one cached value of a namespace."""

    def __init__(
        self,
        cache: LayeredCache,
        *,
        render: Callable[[Any], bytes] = msgspec.json.encode,
        media_type: str = "application/json",
    ) -> None:
        self._cache = cache
        self._render = render
        self._media_type = media_type
        namespaces = cache.config.namespaces
        self._control = {name: cache_control(ns) for name, ns in namespaces.items()}
        # The memo pays where L1 hands back the object it holds. Without L2, that is the
        # loader's (or set()'s) own object, which its owner may change in place and hand
        # in again: the same object is no proof of the same value (as for a value that
        # could not be encoded: ``Served.owned``). Without L1, every read decodes a new
        # object, which the memo would only keep alive (up to its size, each value up
        # to max_value_bytes). In both the ETag is computed from the body each time.
        policies = [cache.namespace(name).policy for name in namespaces]
        memoized = {p.name: p.l1.max_entries for p in policies if p.l1 is not None and p.l2}
        self._unmemoized = set(namespaces) - set(memoized)
        held = sum(memoized.values())
        # At most as many as L1 holds: values L1 let go are kept no longer than that.
        self._etags = ETags(max_entries=max(1, held), etag_of=self._etag_of)

    def cache_control(self, namespace: str) -> str:
        """The ``Cache-Control`` of ``namespace``'s responses (for hand-built ones)."""
        return self._control[namespace]

    async def respond(
        self,
        request: Request,
        namespace: str,
        fields: Mapping[str, object],
        loader: Callable[[], Awaitable[Any]],
        *,
        tags: TagsOf | None = None,
    ) -> Response:
        """200 with the value (from L1, L2 or ``loader``), or 304 if the client's
        ``If-None-Match`` names the current version. Loader errors propagate."""
        if tags is not None and not callable(tags):
            tags = tag_names(tags, None)  # read twice: by the cache and for the header
        ns = self._cache.namespace(namespace)
        key = ns.key(fields)
        served = await ns._serve(key, loader, tags)
        value, control = served.value, self._control[namespace]
        if_none_match = _if_none_match(request)
        if control == "no-store" or served.superseded:
            # no-store: live data, no validator, nobody keeps it. Superseded: a write
            # overtook this load and its purge went out before this response; the caller
            # may have the value (its read began first), a gateway must not keep it.
            # Without a validator only ``*`` can match: a representation exists.
            headers = {"Cache-Control": "no-store"}
            if "*" in (candidate.strip() for candidate in if_none_match.split(",")):
                return _not_modified(request, headers)
            return self._body(value, headers)
        body: bytes | None = None
        if namespace in self._unmemoized or served.owned:
            body = self._render(value)  # rendered once: for the tag, then maybe sent
            etag = body_etag(body, self._media_type)
        else:
            etag = self._etags.of(key, value)
        headers = {"Cache-Control": control, "ETag": etag, KEY_HEADER: key}
        # Checked as a miss checks them: a hit never called the tags function, and a
        # tag only the header would see (``"a,b"``, two to a ban regex) is refused.
        if tag_list := check_tags(ns.policy, tag_names(tags, value) if callable(tags) else tags):
            headers[TAGS_HEADER] = "," + ",".join(tag_list) + ","
        if matches(if_none_match, etag):
            return _not_modified(request, headers)
        return self._body(value, headers, body)

    def _etag_of(self, value: Any) -> str:
        """The tag of what a 200 sends for ``value``: its body, rendered once per fill."""
        return body_etag(self._render(value), self._media_type)

    def _body(self, value: Any, headers: dict[str, str], body: bytes | None = None) -> Response:
        if body is None:
            body = self._render(value)
        return Response(body, headers=headers, media_type=self._media_type)


def _if_none_match(request: Request) -> str:
    """Every ``If-None-Match`` line as one list (RFC 9110 5.3: lines of one field name
    are one comma-separated list; reading the first alone missed a tag on the second)."""
    return ", ".join(request.headers.getlist("if-none-match"))


def _not_modified(request: Request, headers: dict[str, str]) -> Response:
    """A matching ``If-None-Match``: 304 for GET and HEAD, 412 otherwise (RFC 9110
    13.1.2). RFC 9110 15.4.5: a 304 carries the validators and caching headers a 200
    would."""
    if request.method not in ("GET", "HEAD"):
        return Response(status_code=412, headers=headers)
    return Response(status_code=304, headers=headers)
