"""The HTTP layer's promises tried hard: a dead gateway beside a live one, a purger
raising a CancelledError of another task's, a cancelled invalidate() whose DEL is slow,
If-None-Match over several header lines and `*` without a validator (docs/http.md,
RFC 9110 13.1.2). Real Redis; the ASGI app through httpx; small asyncio HTTP servers
stand in for Varnish where a real one adds nothing (tests/test_varnish.py runs one)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layered_cache import LayeredCache, parse_config
from tests.faults.proxy import ToxicProxy
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(60)


def _config(redis_url: str, prefix: str, purge: dict[str, Any] | None = None, **book: Any) -> Any:
    return parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "5s"},
            "purge": purge or {"repeat_after": "0s"},
            "namespaces": {
                "book": {"key": "book:{id}", "http": {"s_maxage": "30s"}, **book},
                "stock": {"key": "stock:{id}", "cache": False},
            },
        },
        env={},
    )


@contextlib.asynccontextmanager
async def _client(
    cache: LayeredCache, catalogue: dict[int, Any]
) -> AsyncIterator[httpx.AsyncClient]:
    from layered_cache.asgi import CachedResponses

    responses = CachedResponses(cache)

    def route(namespace: str) -> Any:
        async def endpoint(request: Request) -> Response:
            book_id = int(request.path_params["id"])

            async def load() -> Any:
                return dict(catalogue[book_id])

            return await responses.respond(request, namespace, {"id": book_id}, load)

        return endpoint

    app = Starlette(
        routes=[
            Route("/books/{id}", route("book"), methods=["GET", "POST"]),
            Route("/stock/{id}", route("stock"), methods=["GET", "POST"]),
        ]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


class Recording:
    """A purger that records when each purge was accepted."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, list[str], list[str]]] = []

    async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
        self.calls.append((time.monotonic(), list(keys), list(tags)))


class FakeVarnish:
    """An HTTP server answering every request 200 (or never, ``hang``), recording the
    ``X-Cache-Key`` of each PURGE with when it arrived."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.purged: list[tuple[float, str]] = []
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def start(self) -> FakeVarnish:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                if self.hang:
                    await self._stopped.wait()
                    return
                for line in head.split("\r\n"):
                    if line.lower().startswith("x-cache-key:"):
                        self.purged.append((time.monotonic(), line.split(":", 1)[1].strip()))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()

    async def stop(self) -> None:
        self._stopped.set()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
        await asyncio.sleep(0.05)


# -- purge delivery ---------------------------------------------------------------------


async def test_a_dead_gateway_beside_a_live_one_holds_back_every_purge_to_the_live_one(
    redis_url: str, prefix: str
) -> None:
    """docs/http.md: "With it, the gateway drops its copy right after the change" and "a
    slow gateway only delays purges, a dead one makes them fail after retries". With two
    Varnishes in ``[purge] urls`` and one of them hung, each purge waits for the hung
    one's timeouts and backoffs (4 x timeout + 2.6 s) before the next purge is sent to
    anyone: the live gateway gets the third change's purge seconds late, the tenth
    well past its ``s_maxage`` (30 s). The live gateway must not pay for the dead one."""
    live, dead = await FakeVarnish().start(), await FakeVarnish(hang=True).start()
    config = _config(
        redis_url,
        prefix,
        purge={"urls": [live.url, dead.url], "timeout": "300ms", "repeat_after": "0s"},
    )
    try:
        async with LayeredCache.from_config(config) as cache:
            started = time.monotonic()
            for book_id in range(3):
                await cache.invalidate("book", {"id": book_id})
            wanted = {cache.key("book", {"id": book_id}) for book_id in range(3)}
            await eventually(lambda: wanted <= {key for _, key in live.purged}, timeout=8)
            late = max(at for at, key in live.purged if key in wanted) - started
            assert late < 1.0, f"the live gateway got the 3rd purge {late:.1f} s after the change"
    finally:
        await live.stop()
        await dead.stop()


async def test_a_purger_that_raises_cancelled_error_stops_every_later_purge(
    redis_url: str, prefix: str
) -> None:
    """docs/http.md: a purger is "one method, async purge(keys, tags), raising on
    failure", and every undelivered purge is "logged and counted". A purger whose call
    raises CancelledError without anyone cancelling the queue (it awaited a task someone
    else cancelled: a shared client being reset) ends the queue's only worker for good:
    ``_deliver`` re-raises it, ``start()`` sees a worker and never makes another. Every
    later invalidate() purges nothing, nothing is counted failed or dropped, and
    ``drain()`` never returns. (The loader path turns the same case into an error:
    ``_miss.LoaderCancelledError``.)"""

    class Flaky(Recording):
        def __init__(self) -> None:
            super().__init__()
            self.first = True

        async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
            if self.first:
                self.first = False
                shared = asyncio.get_running_loop().create_task(asyncio.sleep(10))
                asyncio.get_running_loop().call_soon(shared.cancel)
                await shared  # someone else's task, cancelled: CancelledError here
            await super().purge(keys, tags)

    purger = Flaky()
    async with LayeredCache.from_config(_config(redis_url, prefix), purger=purger) as cache:
        await cache.invalidate("book", {"id": 1})
        await asyncio.sleep(0.1)
        await cache.invalidate("book", {"id": 2})
        key = cache.key("book", {"id": 2})
        delivered = await eventually(
            lambda: any(key in keys for _, keys, _ in purger.calls), timeout=3
        )
        stats = cache.purge_stats()
        assert delivered, f"book:2 never purged; stats {stats}"


# -- purge ordering ---------------------------------------------------------------------


async def test_a_cancelled_invalidate_purges_before_its_delete_lands_so_the_gateway_recaches(
    redis_url: str, prefix: str
) -> None:
    """docs/http.md: "the purge leaves right after the L2 delete"; the bound with purging
    is "purge delay, or repeat_after in that rare race". An invalidate() whose caller is
    cancelled (a client hanging up on the PUT) keeps deleting in the background
    (``to_completion``), but ``Coherence.invalidate`` submits the purge in its ``finally``
    at once: the purge and its repeat reach the gateway while the DEL has not reached
    Redis. The gateway refetches after each purge (from another instance), gets the old
    price from L2 with s-maxage 30 s, and no purge is left to remove that copy."""
    address = urlsplit(redis_url)
    proxy = await ToxicProxy(address.hostname or "127.0.0.1", address.port or 6379).start()
    proxied_url = redis_url.replace(f":{address.port}/", f":{proxy.port}/", 1)
    catalogue = {1: {"id": 1, "price": "9.90"}}
    copies: list[httpx.Response] = []  # what the gateway fetched after each purge

    class Gateway(Recording):
        fetch: httpx.AsyncClient | None = None

        async def purge(self, keys: Sequence[str], tags: Sequence[str]) -> None:
            await super().purge(keys, tags)
            assert self.fetch is not None
            copies.append(await self.fetch.get("/books/1"))  # the refetch after a purge

    gateway = Gateway()
    writer_config = _config(proxied_url, prefix, purge={"repeat_after": "300ms"})
    try:
        async with (
            LayeredCache.from_config(writer_config, purger=gateway) as writer,
            LayeredCache.from_config(_config(redis_url, prefix)) as other,
            _client(other, catalogue) as fetch,  # the instance the gateway asks
        ):
            gateway.fetch = fetch

            async def load() -> Any:
                return dict(catalogue[1])

            await writer.get_or_load("book", {"id": 1}, load)  # L2 holds 9.90
            catalogue[1]["price"] = "1.00"  # the database commit
            proxy.hold_at = b"$3\r\nDEL\r\n"  # the DEL is slow to reach Redis
            task = asyncio.create_task(writer.invalidate("book", {"id": 1}))
            await asyncio.wait_for(proxy.holding.wait(), 5)
            task.cancel()  # the client hung up
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(1.0)  # the DEL still on its way
            proxy.release.set()
            assert await eventually(lambda: len(gateway.calls) >= 2, timeout=5)  # and repeat
            await writer._rt.purges.drain()
            last = copies[-1]  # the copy the gateway keeps
            kept = "no-store" not in last.headers["cache-control"]
            assert not (kept and last.json()["price"] == "9.90"), (
                f"after the last purge the gateway keeps the old price "
                f"({last.headers['cache-control']!r}); purges at "
                f"{[round(at - gateway.calls[0][0], 2) for at, _, _ in gateway.calls]} s"
            )
    finally:
        proxy.release.set()
        await proxy.stop()


# -- conditional requests (RFC 9110 13.1.2) ---------------------------------------------


async def test_if_none_match_sent_as_two_header_lines_is_one_list(
    redis_url: str, prefix: str
) -> None:
    """RFC 9110 5.3: field lines of one name are one comma-separated list, and 13.1.2
    (which docs/http.md and ``http.matches`` cite) evaluates the whole list. A client or
    proxy that sends ``If-None-Match`` as two lines, the current tag in the second, gets
    the full body: ``respond`` reads only the first line (``headers.get``)."""
    async with (
        LayeredCache.from_config(_config(redis_url, prefix)) as cache,
        _client(cache, {1: {"id": 1, "price": "9.90"}}) as client,
    ):
        etag = (await client.get("/books/1")).headers["etag"]
        reply = await client.get(
            "/books/1", headers=[("If-None-Match", '"other"'), ("If-None-Match", etag)]
        )
        assert reply.status_code == 304


async def test_if_none_match_star_on_a_post_to_a_no_store_namespace_is_a_412(
    redis_url: str, prefix: str
) -> None:
    """docs/http.md: 304 "when If-None-Match names the current ETag (or is *)", and "a
    matching If-None-Match on a method other than GET or HEAD is a 412 ... (RFC 9110
    13.1.2)". ``*`` matches any current representation, validator or not (13.1.2: "the
    condition is false if the origin server has a current representation"). In a
    no-store namespace (``stock``) ``respond`` returns before evaluating it: a POST with
    ``If-None-Match: *`` (the standard "only if none exists" precondition) proceeds
    with a 200."""
    async with (
        LayeredCache.from_config(_config(redis_url, prefix)) as cache,
        _client(cache, {1: {"id": 1, "count": 3}}) as client,
    ):
        reply = await client.post("/stock/1", headers={"If-None-Match": "*"})
        assert reply.status_code == 412
