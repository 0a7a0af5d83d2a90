"""Optional OpenTelemetry spans around loads.

    from layered_cache._tracing import instrument
    instrument(cache)      # True if opentelemetry-api is installed, else False (no-op)

Each loader call then runs inside a ``layered_cache.load`` span (attribute
``cache.namespace``), as the current span, so the database spans of the loader nest
under it. Errors are recorded on the span by OpenTelemetry. Nothing is imported unless
``instrument`` is called, and ``opentelemetry-api`` is not a dependency: without it (or
without an SDK configured) this costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layered_cache._cache import LayeredCache
    from layered_cache.sync import SyncLayeredCache

__all__ = ["SPAN_NAME", "instrument", "load_tracer"]

SPAN_NAME = "layered_cache.load"


def load_tracer() -> Any | None:
    """The ``layered_cache`` tracer, or None if opentelemetry-api is not importable."""
    try:
        trace: Any = importlib.import_module("opentelemetry.trace")
    except ImportError:
        return None
    from layered_cache import __version__  # at call time: the package imports this module

    return trace.get_tracer("layered_cache", __version__)


def instrument(cache: LayeredCache | SyncLayeredCache, tracer: Any | None = None) -> bool:
    """Wrap every load of ``cache`` in a span. Returns whether tracing is active. A
    ``SyncLayeredCache`` (or its ``.cache``) keeps the wrapper on every inner cache it
    builds, after a fork or ``close()`` + ``start()`` too (``_sync_inner``)."""
    tracer = tracer if tracer is not None else load_tracer()
    if tracer is None:
        return False

    async def traced(namespace: str, loader: Callable[[], Awaitable[Any]]) -> Any:
        with tracer.start_as_current_span(SPAN_NAME, attributes={"cache.namespace": namespace}):
            return await loader()

    cache.hooks.load_wrapper = traced
    return True
