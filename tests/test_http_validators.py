"""``CachedResponses`` on a bare Starlette app: validators a client may rely on.

Two holes found by an adversarial review (2026-12-04), each failing before its fix: a
namespace without L2 kept the old ETag for a changed value (L1 holds the loader's own
object, which its owner changed in place: the ETag memo went by identity), and a POST
whose ``If-None-Match`` matched got a 304 (RFC 9110 13.1.2: 412 for such methods).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layered_cache import LayeredCache, parse_config
from layered_cache.asgi import CachedResponses


def _config(redis_url: str, prefix: str, **namespace: Any) -> Any:
    book = {"key": "book:{id}", "http": {"s_maxage": "30s"}, **namespace}
    return parse_config(
        {"redis": {"url": redis_url, "prefix": prefix}, "namespaces": {"book": book}}, env={}
    )


@contextlib.asynccontextmanager
async def client_of(
    cache: LayeredCache, catalogue: dict[int, Any]
) -> AsyncIterator[httpx.AsyncClient]:
    responses = CachedResponses(cache)

    async def book(request: Request) -> Response:
        book_id = int(request.path_params["id"])

        async def load() -> Any:
            return catalogue[book_id]

        return await responses.respond(request, "book", {"id": book_id}, load)

    app = Starlette(routes=[Route("/books/{id}", book, methods=["GET", "POST"])])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        yield client


async def test_without_l2_a_value_changed_in_place_gets_a_new_etag(
    redis_url: str, prefix: str
) -> None:
    catalogue = {1: {"id": 1, "price": "9.90"}}  # an in-memory store, an ORM identity map
    async with (
        LayeredCache.from_config(_config(redis_url, prefix, l2=False)) as cache,
        client_of(cache, catalogue) as client,
    ):
        first = await client.get("/books/1")
        catalogue[1]["price"] = "1.00"  # the same object, changed
        await cache.invalidate("book", {"id": 1})
        second = await client.get("/books/1")
        assert second.json()["price"] == "1.00"
        assert second.headers["etag"] != first.headers["etag"]
        again = await client.get("/books/1", headers={"If-None-Match": first.headers["etag"]})
        assert again.status_code == 200 and again.json()["price"] == "1.00"
        same = await client.get("/books/1", headers={"If-None-Match": second.headers["etag"]})
        assert same.status_code == 304


async def test_a_post_whose_if_none_match_matches_is_a_412_not_a_304(
    redis_url: str, prefix: str
) -> None:
    async with (
        LayeredCache.from_config(_config(redis_url, prefix)) as cache,
        client_of(cache, {1: {"id": 1}}) as client,
    ):
        reply = await client.post("/books/1", headers={"If-None-Match": "*"})
        assert reply.status_code == 412
        assert (await client.get("/books/1", headers={"If-None-Match": "*"})).status_code == 304


async def test_two_renderings_of_one_value_never_share_an_etag(
    redis_url: str, prefix: str
) -> None:
    """A strong ETag names one representation. It was a digest of the value alone, so
    ``/books/1`` (JSON) and ``/books/1.txt`` (text), or the same route after a deploy that
    changed ``render``, had one tag: a client holding the other body got a 304 for it."""
    catalogue = {1: {"id": 1, "price": "9.90"}}
    async with LayeredCache.from_config(_config(redis_url, prefix)) as cache:
        as_json = CachedResponses(cache)
        as_text = CachedResponses(
            cache, render=lambda value: f"{value['id']}: {value['price']}".encode(),
            media_type="text/plain",
        )

        async def respond(request: Request, responses: CachedResponses) -> Response:
            async def load() -> Any:
                return catalogue[1]

            return await responses.respond(request, "book", {"id": 1}, load)

        async def json_page(request: Request) -> Response:
            return await respond(request, as_json)

        async def text_page(request: Request) -> Response:
            return await respond(request, as_text)

        app = Starlette(routes=[Route("/books/1", json_page), Route("/books/1.txt", text_page)])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            text = await client.get("/books/1.txt")
            json_reply = await client.get("/books/1", headers={"If-None-Match": text.headers["etag"]})
            assert json_reply.status_code == 200 and json_reply.json() == catalogue[1]
            assert json_reply.headers["etag"] != text.headers["etag"]
            again = await client.get("/books/1.txt", headers={"If-None-Match": text.headers["etag"]})
            assert again.status_code == 304  # its own tag still matches
