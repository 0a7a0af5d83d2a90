"""The sync API's loader pool: ``ThreadPoolExecutor``'s bounded pool of reused threads,
on daemon threads.

A caller that times out leaves its loader running (``_sync_loaders``), and nothing can
stop a thread blocked in a database call. ``concurrent.futures`` joins a
``ThreadPoolExecutor``'s workers at interpreter exit, so one loader stuck on a database
that hangs kept the process from exiting after ``close()`` for as long as the database
hung: a script, a management command, a worker being recycled. The overflow and nested
loader threads are daemon threads for the same reason; these are too, so an abandoned
loader dies with the process, as its caller already gave up on it.

Threads start as work arrives, up to ``max_workers``, and are kept for the next loader.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["DaemonThreadPool"]

T = TypeVar("T")

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadPool(Executor):
    """At most ``max_workers`` daemon threads named ``<name>_<n>`` running what is
    submitted, in order."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # threads waiting for work
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                name = f"{self._name}_{len(self._threads)}"
                thread = threading.Thread(target=self._serve, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            future, fn, args, kwargs = work
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the future's: the thread serves on
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del work, future, fn, args, kwargs  # not held while waiting for the next
            self._idle.release()
        self._work.put(None)  # shutdown: the next thread's turn to leave

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; with ``cancel_futures``, work not started yet never starts;
        ``wait``: until every thread has finished its work (the sync API never waits: a
        loader may never return, see the module doc)."""
        with self._lock:
            self._shut = True
        if cancel_futures:
            while True:
                try:
                    work = self._work.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
        self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
