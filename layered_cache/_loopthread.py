"""A private event loop on a daemon thread, with a pool of daemon threads for sync
loaders (``_daemonpool``): what ``SyncLayeredCache`` runs the async core on.

A loop thread belongs to the process that started it. ``fork()`` copies only the calling
thread: in the child the loop object, its sockets and the pool look alive but nothing
runs them, so a coroutine submitted there is never executed and ``.result()`` waits
forever. ``LoopThread.pid`` lets the owner tell (``owned_here``) and build a new one;
the inherited one is abandoned, never stopped or closed (see ``abandon``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from layered_cache._daemonpool import DaemonThreadPool
from layered_cache._sync_loaders import LoaderInterrupted

__all__ = ["LoopThread", "SyncTimeoutError", "check_timeout"]

T = TypeVar("T")

# Loop threads (and whatever they held: caches, Redis connections) inherited through a
# fork. Kept referenced, so the child never runs their finalizers: closing a copied
# connection could write on a socket the parent still uses, and a half-copied loop is
# no place to run cleanup code. A fork happens a handful of times per process.
_INHERITED: list[object] = []


class SyncTimeoutError(TimeoutError):
    """A sync call did not finish within ``SyncLayeredCache``'s ``timeout``."""


def check_timeout(timeout: object) -> None:
    """``timeout`` is None or a number of seconds > 0 (``ValueError`` otherwise). Checked
    at construction: a string (Django's OPTIONS, from an env var) failed every call with
    a TypeError from deep in ``threading``, and 0 or less every call with "starting the
    cache did not finish within 0 s", retried at each."""
    wrong = f"timeout must be None or a number of seconds > 0, got {timeout!r}"
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(wrong)
    if not 0 < timeout < math.inf:  # NaN too
        raise ValueError(wrong)


class LoopThread:
    """An event loop running forever on its own daemon thread, plus the loader pool."""

    def __init__(self, max_workers: int) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        loop = self.loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            try:
                _cancel_leftovers(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

        self.thread = threading.Thread(target=run, name="layered-cache-loop", daemon=True)
        self.thread.start()
        ready.wait()
        # Daemon threads: a loader its caller gave up on must not hold the process's
        # exit (``_daemonpool``).
        self.executor = DaemonThreadPool(max_workers, "layered-cache-loader")
        self._calls: set[concurrent.futures.Future[Any]] = set()  # in flight, any thread
        self._calls_lock = threading.Lock()

    @property
    def owned_here(self) -> bool:
        """False in a forked child: this loop's thread exists only in the parent."""
        return self.pid == os.getpid()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop and block for its result, at most ``timeout`` s."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self._calls_lock:
            self._calls.add(future)
        try:
            # Waited for apart from taking the result: ``future.result(timeout)`` raises
            # the builtin TimeoutError both when time runs out and when the call itself
            # failed with one (a loader's socket or database read timeout), which would
            # be reported as this call's timeout, the loader's error lost.
            # A timeout past what a lock wait takes (``threading.TIMEOUT_MAX``, ~292
            # years) raised OverflowError at every call: it is waited for as no bound.
            bound = None if timeout is None or timeout >= threading.TIMEOUT_MAX else timeout
            if not concurrent.futures.wait([future], bound).done:
                future.cancel()  # the task is cancelled on the loop: no orphan keeps running
                raise SyncTimeoutError(
                    f"{what} did not finish within {timeout} s (SyncLayeredCache timeout=); "
                    "raise the timeout if the loader is legitimately slow"
                )
            return future.result()
        except LoaderInterrupted as exc:  # see ``_sync_loaders``: raised here, as it was
            raise exc.error from None
        except concurrent.futures.CancelledError:
            raise RuntimeError(f"{what}: the cache was closed while this call ran") from None
        finally:
            with self._calls_lock:
                self._calls.discard(future)

    def cancel_calls(self) -> None:
        """Cancel the calls other threads have in flight (``close``): their tasks are
        cancelled on the loop before the cache closes, so what a cancelled call does
        on its way out (give its lease back, ``_miss``) still finds Redis open."""
        with self._calls_lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def stop(self, timeout: float = 10.0) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def abandon(self, *held: object) -> None:
        """In a forked child: forget this loop (and ``held``) without touching them."""
        _INHERITED.append((self, held))


def _cancel_leftovers(loop: asyncio.AbstractEventLoop, timeout: float = 5.0) -> None:
    """Cancel tasks still pending after close (e.g. a listener mid-XREAD) and let them
    finish, so none is destroyed pending when the loop closes."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
