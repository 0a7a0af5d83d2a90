"""A WSGI app that creates and starts its ``SyncLayeredCache`` at import, as an app
served with ``gunicorn --preload`` does: the master imports it, then forks workers.

Configured by environment: ``LC_REDIS_URL``, ``LC_PREFIX``. ``GET /book/<id>`` answers
``{"pid": ..., "value": ...}`` (the value loaded through the cache: ``"v1"``, or what
``PUT``-less tests wrote with another cache); ``GET /loads`` counts this worker's loads;
``GET /typed/<id>`` names the type ``typed_book`` (a function cached at import, which
declares ``Book``) returned; ``GET /metrics`` is Prometheus's, the cache registered at
import as docs/metrics.md says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from layered_cache import parse_config
from layered_cache.prometheus import register_cache, render_metrics
from layered_cache.sync import SyncLayeredCache

config = parse_config(
    {
        "redis": {"url": os.environ["LC_REDIS_URL"], "prefix": os.environ["LC_PREFIX"]},
        "namespaces": {
            "book": {"key": "book:{id}", "l1": {"ttl": "1m"}},
            "typed": {"key": "typed:{id}", "l1": {"ttl": "1m"}},
        },
    },
    source="<wsgi_books>",
    env={},
)
cache = SyncLayeredCache.from_config(config, timeout=5.0)
cache.start()  # in the master, before the fork: the case that used to hang
# Warm it in the master too: the workers inherit a populated L1 and live connections.
cache.get_or_load("book", {"id": 0}, lambda: "master")
loads = 0
registry = CollectorRegistry()
register_cache(cache.cache, registry)  # the master's inner cache: each worker builds its own


class Book(msgspec.Struct):
    id: int
    title: str


@cache.cached("typed")
def typed_book(id: int) -> Book:
    return Book(id=id, title="Emma")


typed_book(1)  # in L2 for the workers, whose first read of it is an L2 hit


def _load() -> str:
    global loads
    loads += 1
    return "v1"


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ["PATH_INFO"]
    if path.startswith("/book/"):
        value = cache.get_or_load("book", {"id": int(path.removeprefix("/book/"))}, _load)
        body: dict[str, Any] = {"pid": os.getpid(), "value": value}
    elif path.startswith("/typed/"):
        book = typed_book(int(path.removeprefix("/typed/")))
        body = {"pid": os.getpid(), "type": type(book).__name__}
    elif path == "/metrics":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [render_metrics(registry)[0]]
    else:
        body = {"pid": os.getpid(), "loads": loads}
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps(body).encode()]
