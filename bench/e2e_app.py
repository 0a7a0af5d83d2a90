"""The bookstore of ``bench/e2e_wrk.py`` in one of three cache configurations.

``uvicorn --factory bench.e2e_app:create_app`` runs it in a server process of its own;
the mode comes from the environment because a factory takes no arguments:

- ``E2E_MODE=l1``: examples/bookstore/bookstore.toml as shipped (L1 + L2).
- ``E2E_MODE=l2``: the same ``book`` namespace with ``l1 = false``: every read is a GET
  to Redis (an L2 hit once warm).
- ``E2E_MODE=db``: ``book`` with ``cache = false``: every read is the database join.

``E2E_PREFIX`` is the Redis prefix (one per server, so they share nothing),
``REDIS_URL`` the Redis, ``BOOKSTORE_QUERY_DELAY`` the database's added latency per read
(the example's own knob). Only ``book`` changes: the app, its routes, the response
headers (Cache-Control, ETag) and the other namespaces are the example's.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any

from examples.bookstore.app import DEFAULT_CONFIG, BookstoreSettings
from examples.bookstore.app import create_app as _bookstore
from layered_cache import Config

__all__ = ["MODES", "book_namespace", "bookstore_config", "create_app"]

MODES = ("l1", "l2", "db")


def book_namespace(mode: str) -> dict[str, Any]:
    """The ``[namespaces.book]`` table for ``mode``, from the example's own file."""
    book: dict[str, Any] = tomllib.loads(DEFAULT_CONFIG.read_text())["namespaces"]["book"]
    if mode == "l1":
        return book
    if mode == "l2":
        return {**book, "l1": False}
    if mode == "db":
        # Only the key: a never-cached namespace has no layers, stampede or http policy
        # (an http policy would be ignored with a warning: it is always no-store).
        return {"key": book["key"], "cache": False}
    raise ValueError(f"E2E mode must be one of {MODES}, got {mode!r}")


def bookstore_config(mode: str, redis_url: str, prefix: str) -> Config:
    from examples.bookstore.app import load_bookstore_config

    namespaces = tomllib.loads(DEFAULT_CONFIG.read_text())["namespaces"]
    namespaces["book"] = book_namespace(mode)
    return load_bookstore_config(
        redis_url=redis_url, prefix=prefix, env={},  # env={}: no stray LAYERED_CACHE_* or Kafka
        overrides={"namespaces": namespaces, "logging": {"level": "error"}},
    )  # fmt: skip


def create_app() -> Any:
    """The uvicorn factory: the bookstore for ``$E2E_MODE``, no Kafka (a price change
    would invalidate directly; the benchmark only reads)."""
    config = bookstore_config(
        os.environ.get("E2E_MODE", "l1"), os.environ["REDIS_URL"], os.environ["E2E_PREFIX"]
    )
    return _bookstore(BookstoreSettings(config=config, database_url="", produce_events=False))
