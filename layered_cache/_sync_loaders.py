"""Where the sync API's loaders run: a sync loader must not block the loop thread, so
it runs on the thread pool, in a copy of the caller's context; a loader that itself calls
the cache (a nested cached function) runs on a thread of its own, since queueing it
behind the pool its caller occupies could wait forever. For the same reason, when such a
nested call begins, the loaders still queued for the pool get threads of their own too:
the nested call may join one of them (single-flight), and it would wait behind the very
pool thread that waits for it. A loader that needs its own key is refused
(``RecursionError``) rather than waiting for itself."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

__all__ = ["LoaderThreads"]

T = TypeVar("T")


class LoaderThreads:
    def __init__(self) -> None:
        # Per thread: the keys whose loaders this thread is running (outermost first).
        # Set only on loader threads; nested calls from them take the nested path.
        self._loading = threading.local()
        self._queued: set[_Job[Any]] = set()  # top-level loaders waiting for the pool
        self._queued_lock = threading.Lock()

    def chain(self) -> tuple[str, ...]:
        keys: tuple[str, ...] = getattr(self._loading, "keys", ())
        return keys

    def check_not_own_key(self, key: str) -> None:
        chain = self.chain()
        if key in chain:
            path = " -> ".join((*chain[chain.index(key) :], key))
            raise RecursionError(
                f"the loader of {key!r} needs {key!r} itself ({path}): it would wait for "
                "its own load forever"
            )

    def wrap(
        self, key: str, loader: Callable[[], T], executor: Executor | None
    ) -> Callable[[], Coroutine[Any, Any, T]]:
        """An async loader running the sync ``loader`` for ``key`` (see module doc)."""
        return self.wrap_chain([key], loader, executor)

    def wrap_many(
        self,
        keys: Sequence[str],
        load_many: Callable[[list[Any]], Sequence[Any]],
        executor: Executor | None,
    ) -> Callable[[list[Any]], Coroutine[Any, Any, Sequence[Any]]]:
        """``wrap`` for a batch loader: it is loading every key of the batch."""

        async def load(fields_list: list[Any]) -> Sequence[Any]:
            wrapped = self.wrap_chain(keys, lambda: load_many(fields_list), executor)
            return await wrapped()

        return load

    def wrap_chain(
        self, keys: Sequence[str], loader: Callable[[], T], executor: Executor | None
    ) -> Callable[[], Coroutine[Any, Any, T]]:
        """``loader`` on the pool, marked as loading ``keys``; nested: its own thread."""
        context = contextvars.copy_context()
        outer = self.chain()
        chain = (*outer, *keys)

        def run_marked() -> T:
            self._loading.keys = chain
            try:
                return context.run(loader)
            finally:
                self._loading.keys = ()

        async def load() -> T:
            loop = asyncio.get_running_loop()
            if outer:
                return await _in_own_thread(loop, run_marked)
            job = _Job(run_marked, loop)
            with self._queued_lock:
                self._queued.add(job)
            loop.run_in_executor(executor, job.run)
            try:
                return await job.done
            finally:
                job.take()  # cancelled before it started: it never will
                with self._queued_lock:
                    self._queued.discard(job)

        if outer:  # a nested call begins: see the module doc
            self._unblock_queued()
        return load

    def _unblock_queued(self) -> None:
        with self._queued_lock:
            queued = list(self._queued)
        for job in queued:
            name = "layered-cache-unqueued-loader"
            threading.Thread(target=job.run, name=name, daemon=True).start()


class _Job(Generic[T]):
    """A top-level loader handed to the pool, which a thread of its own may start first
    (``LoaderThreads._unblock_queued``): whoever takes it runs it, once."""

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop) -> None:
        self._fn = fn
        self._loop = loop
        self._lock = threading.Lock()
        self._taken = False
        self.done: asyncio.Future[T] = loop.create_future()

    def take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def run(self) -> None:
        if not self.take():
            return
        done = self.done
        try:
            result = self._fn()
        except BaseException as exc:  # handed to the awaiting task, not lost in the thread
            outcome = functools.partial(done.set_exception, exc)
        else:
            outcome = functools.partial(done.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (close())
            self._loop.call_soon_threadsafe(_settle, done, outcome)


def _settle(future: asyncio.Future[Any], outcome: Callable[[], None]) -> None:
    if not future.done():
        outcome()


async def _in_own_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a new daemon thread (a nested load: see the module doc)."""
    job = _Job(fn, loop)
    threading.Thread(target=job.run, name="layered-cache-nested-loader", daemon=True).start()
    return await job.done
