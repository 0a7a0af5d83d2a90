"""The Django backend from async code (an async view): the sync methods refused at once,
without touching the loop; the async methods keeping the promises of the sync ones."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests import djangoconf

djangoconf.configure()

from layered_cache._django_setup import close_shared  # noqa: E402
from layered_cache.django import LayeredCacheBackend  # noqa: E402


def backend(redis_url: str, prefix: str, **options: Any) -> LayeredCacheBackend:
    """As tests/test_django_backend.py builds one: distinct options, distinct process."""
    config = options.pop("config", {})
    section = config.setdefault("redis", {})
    section.update({"url": redis_url, "prefix": prefix})
    section.setdefault("timeout", "3s")
    section.setdefault("connect_timeout", "3s")
    return LayeredCacheBackend("", {"OPTIONS": {"config": config, **options}})


@pytest.fixture(autouse=True)
def _close_shared() -> Iterator[None]:
    yield
    close_shared()


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A Redis that accepts connections and never answers (a hung server)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


def test_a_first_sync_call_in_an_async_view_is_refused_without_freezing_the_loop(
    silent_redis: str, prefix: str
) -> None:
    """docs/django.md, the API table: "the sync methods (``cache.get``) refuse to run
    inside a running event loop with a ``RuntimeError``, even for an L1 hit (they would
    block the loop)".

    Scenario: an async view's first use of the backend is the sync ``cache.get``, Redis
    hung; a ticker task on the same loop measures how long the loop froze. It was
    refused only after ~3 s, the loop frozen all along: the backend built and started
    the shared ``SyncLayeredCache`` (connect, backplane positioning) from inside the
    loop before ``SyncLayeredCache.get`` refused. Now ``_django_setup.shared`` refuses
    before it builds anything."""
    config = {"redis": {"timeout": "0.5s", "connect_timeout": "0.5s"}}
    cache = backend(silent_redis, prefix, config=config)

    async def view() -> tuple[float, float, str]:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        try:
            cache.get("answer")
            outcome = "no error"
        except RuntimeError as exc:
            outcome = str(exc)
        took = time.monotonic() - started
        await asyncio.sleep(0.05)
        tick.cancel()
        return took, max(gaps), outcome

    took, longest_freeze, outcome = asyncio.run(view())
    assert outcome.startswith("SyncLayeredCache called from a running event loop")
    assert took < 0.2 and longest_freeze < 0.2, (took, longest_freeze)
