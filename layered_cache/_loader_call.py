"""Calling the user's loader: through the instrumentation hooks (counted, timed), refused
with a clear error unless it is awaitable, and a ``CancelledError`` nobody aimed at the
load told apart from the caller's own cancellation."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from layered_cache._policy import Policy
from layered_cache._runtime import Hooks

__all__ = ["LoaderCancelledError", "RequestBound", "awaited", "call_loader", "retrieve_outcome"]

Loader = Callable[[], Awaitable[Any]]


T = TypeVar("T")


class RequestBound(Generic[T]):
    """The loader of a ``cached`` function with ``ignore=``: ``fn(*args, **kwargs)``
    with arguments that belong to the request that made the call (a database session,
    an HTTP client). Not refreshed early: the refresh runs in the background after that
    request returned, when they may be closed (every refresh failing, counted as a
    ``load_error``) or still in use by the request (an ``AsyncSession`` used by two
    tasks at once). Such a value is reloaded at its expiry, by a reader with arguments
    of its own, under the lease: still one load per expiry fleet-wide. For the same
    reason no stale answer after ``load_timeout`` for it (``_miss``): its load would run
    on in the background with the closed session; the caller waits for it. A cancelled
    caller's load runs on as any does (it holds the lease; cancelled, a loader running
    in a thread went on anyway while its lease went back: two loads of the key).

    A class of its own, not a flag beside the loader: the mark travels with the loader
    through ``get_or_load`` (and the sync API's wrapping, ``SyncLayeredCache``) to the
    one place that reads it, ``Refresher.maybe_refresh_early``."""

    __slots__ = ("_args", "_fn", "_kwargs")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._fn = fn
        self._args = args
        self._kwargs = kwargs

    def __call__(self) -> T:
        return self._fn(*self._args, **self._kwargs)


def retrieve_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class LoaderCancelledError(RuntimeError):
    """The loader raised ``CancelledError`` while nobody had cancelled the load (it
    awaited a task that someone else cancelled, or raised it itself). Passed on as it
    was, it read as the caller's own cancellation: no stale value served, no load error
    counted, and the calling task ending as if cancelled. It is a load error instead."""


async def call_loader(policy: Policy, hooks: Hooks, loader: Loader) -> Any:
    """Call the loader through the instrumentation hooks, counting loads and failures."""
    policy.stats.load += 1
    started = time.perf_counter()
    ok = False
    task = asyncio.current_task()
    cancels = task.cancelling() if task is not None else 0
    try:
        try:
            if hooks.load_wrapper is not None:
                value = await hooks.load_wrapper(policy.name, loader)
            else:
                value = await awaited(policy.name, loader)
        except asyncio.CancelledError as exc:
            if task is None or task.cancelling() > cancels:
                raise  # our load was cancelled: the caller's cancellation, passed on
            raise LoaderCancelledError(
                f"namespace {policy.name!r}: the loader raised CancelledError without "
                "being cancelled"
            ) from exc
        ok = True
        return value
    except Exception:
        policy.stats.load_error += 1
        raise
    finally:
        for observe in hooks.load_observers:
            observe(policy.name, time.perf_counter() - started, ok)


def awaited(namespace: str, loader: Loader) -> Awaitable[Any]:
    """``loader()``, refused with a clear error unless it is awaitable: a plain function
    passed to the async API would otherwise fail as "object dict can't be used in
    'await' expression", far from the mistake."""
    result = loader()
    if not inspect.isawaitable(result):
        raise TypeError(
            f"namespace {namespace!r}: the loader returned a {type(result).__name__}, not "
            "an awaitable: pass an async function (sync loaders: SyncLayeredCache)"
        )
    return result
