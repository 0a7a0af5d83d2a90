"""The FastAPI (Starlette) pattern the README shows: a module-level cache with
``@cache.cached`` applied at import, ``start()``/``close()`` in the lifespan, and the
cache handed to endpoints as a dependency. Run through FastAPI's TestClient, which runs
the lifespan, against a real Redis."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from layered_cache import Config, LayeredCache
from tests.helpers import make_config


class Book(msgspec.Struct):
    id: int
    title: str


def build_app(config: Config, database: dict[int, str], queries: list[int]) -> FastAPI:
    """What a service module holds at import time."""
    cache = LayeredCache.from_config(config, value_types={"book": Book})

    @cache.cached("book")  # decorated at import: the cache isn't started yet
    async def book_detail(id: int) -> Book:
        queries.append(id)
        return Book(id, database[id])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await cache.start()  # backplane listener, fleet checks: on the server's loop
        try:
            yield
        finally:
            await cache.close()

    app = FastAPI(lifespan=lifespan)

    def get_cache() -> LayeredCache:
        return cache

    @app.get("/books/{id}")
    async def read_book(id: int) -> dict[str, Any]:
        return msgspec.to_builtins(await book_detail(id))  # type: ignore[no-any-return]

    @app.post("/books/{id}/title/{title}")
    async def rename(
        id: int,
        title: str,
        c: LayeredCache = Depends(get_cache),  # noqa: B008 - FastAPI's dependency idiom
    ) -> None:
        database[id] = title
        await c.invalidate("book", {"id": id})

    return app


def test_a_module_level_cache_serves_fastapi_endpoints_through_the_lifespan(
    redis_url: str, prefix: str
) -> None:
    database = {1: "Emma"}
    queries: list[int] = []
    app = build_app(make_config(redis_url, prefix), database, queries)
    with TestClient(app) as client:  # runs the lifespan: start() ... close()
        for _ in range(5):
            assert client.get("/books/1").json() == {"id": 1, "title": "Emma"}
        assert queries == [1]  # one load, then L1
        client.post("/books/1/title/Persuasion")
        assert client.get("/books/1").json() == {"id": 1, "title": "Persuasion"}
        assert queries == [1, 1]
