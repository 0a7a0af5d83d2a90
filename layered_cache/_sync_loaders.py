"""Where the sync API's loaders run: a sync loader must not block the loop thread, so
it runs on the thread pool, in a copy of the caller's context; a loader that itself calls
the cache (a nested cached function) runs on a thread of its own, since queueing it
behind the pool its caller occupies could wait forever. For the same reason, when such a
nested call begins, the loaders still queued for the pool get threads of their own too:
the nested call may join one of them (single-flight), and it would wait behind the very
pool thread that waits for it. A loader that needs its own key is refused
(``RecursionError``) rather than waiting for itself.

A call is nested when its thread runs a loader, or when it runs in a loader's context (a
helper thread started with ``contextvars.copy_context().run``, ``asyncio.to_thread``).
A loader that hands work to threads of its own without its context can't be told from
any other caller; so that such loaders can't fill the pool with threads that all wait
for loads queued behind them, a top-level loader finding every pool thread taken runs on
a thread of its own rather than queueing. A caller that gives up (``SyncTimeoutError``, a
stale value served) leaves its load running (it fills for the others), so with a database
that hangs every timed-out call of another key would leave one more thread: those
overflow threads are capped (``max_overflow``), and past the cap a load fails at once
with ``LoaderThreadsExhausted`` (the caller gets a stale value where the namespace may
serve one, else the error). Failing, not queueing: a queue there would bring back the
wait this rule prevents. The threads of nested loads, and those that unblock queued
loaders, are capped apart (a healthy database's nested loads must not crowd out the
overflow), at ``max_workers + max_overflow`` (as many as may run loaders that nest),
each until its thread ends: a nested load outlives
the loader it belongs to when that loader gives up on it (its nested call timed out),
so against a database that hangs every request left one more hung nested thread. Past
the cap a nested load fails at once too, and a queued loader that would need a thread
of its own fails rather than wait behind the pool.

A loader that raises what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
gevent's ``GreenletExit``) would stop the loop thread itself if handed to it as is
(asyncio re-raises the first two out of the loop): it crosses as ``LoaderInterrupted``
and the sync call raises the original in the caller's thread."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

__all__ = ["LoaderInterrupted", "LoaderThreads", "LoaderThreadsExhausted", "check_limits"]

T = TypeVar("T")

# The keys whose loaders the current context is running: seen by a helper thread that
# runs in a loader's context, where the thread-local mark (``LoaderThreads._loading``)
# is not.
_CHAIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "layered_cache_loading", default=()
)


class LoaderInterrupted(Exception):
    """A sync loader raised ``error``, a ``BaseException`` that is not an ``Exception``:
    carried to the loop as an ordinary failure (the lease goes back, nothing is cached),
    raised again as ``error`` in the caller's thread (``SyncLayeredCache``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"the loader raised {type(error).__name__}")
        self.error = error


class LoaderThreadsExhausted(RuntimeError):
    """A load found every pool thread and every overflow thread busy (``max_overflow``
    loaders still running, say on a database that hangs): it fails now instead of
    starting yet another thread or queueing behind loaders that may be waiting for it."""


def check_limits(pool_size: int, max_overflow: int) -> None:
    """``max_workers`` and ``max_overflow`` make sense (``ValueError`` naming one that
    doesn't). Checked at construction, not at the first overflow: a string from Django's
    OPTIONS would fail only once the pool was full."""
    limits = (("max_workers", pool_size, 1), ("max_overflow", max_overflow, 0))
    for name, value, least in limits:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


_OVERFLOW, _NESTED = "overflow", "nested"  # the kinds of loader threads of their own
_THREAD_NAMES = {_OVERFLOW: "layered-cache-loader", _NESTED: "layered-cache-nested-loader"}


class LoaderThreads:
    def __init__(self, pool_size: int, max_overflow: int) -> None:
        check_limits(pool_size, max_overflow)
        # Per thread: the keys whose loaders this thread is running (outermost first).
        # Set only on loader threads; nested calls from them take the nested path.
        self._loading = threading.local()
        self._queued: set[_Job[Any]] = set()  # top-level loaders waiting for the pool
        self._queued_lock = threading.Lock()
        self._pool_size = pool_size
        self._on_pool = 0  # loaders handed to the pool, not yet done (under _queued_lock)
        self._max_overflow = max_overflow
        # Loaders on threads of their own (under _queued_lock), each kind capped at
        # ``max_overflow``: top-level ones past the pool, and nested or unqueued ones.
        self._own = {_OVERFLOW: 0, _NESTED: 0}

    def fresh(self) -> LoaderThreads:
        """Empty counts with the same limits (a forked child: its threads are gone)."""
        return LoaderThreads(self._pool_size, self._max_overflow)

    def chain(self) -> tuple[str, ...]:
        keys: tuple[str, ...] = getattr(self._loading, "keys", ())
        return keys or _CHAIN.get()

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
        key_of: Callable[[Any], str],
        load_many: Callable[[list[Any]], Sequence[Any]],
        executor: Executor | None,
    ) -> Callable[[list[Any]], Coroutine[Any, Any, Sequence[Any]]]:
        """``wrap`` for a batch loader: it is loading the keys it is called with, not
        every key of the batch (those found cached aren't loaded, and the loader may read
        them: marked as loading, such a read raised a RecursionError)."""

        async def load(fields_list: list[Any]) -> Sequence[Any]:
            keys = [key_of(fields) for fields in fields_list]
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
                return context.run(_call_marked, chain, loader)
            finally:
                self._loading.keys = ()

        async def load() -> T:
            loop = asyncio.get_running_loop()
            if outer:
                return await self._in_own_thread(loop, run_marked, _NESTED)
            job = _Job(run_marked, loop)
            with self._queued_lock:
                spare = self._on_pool < self._pool_size
                if spare:
                    self._on_pool += 1
                    self._queued.add(job)
            if not spare:  # every pool thread taken: see the module doc
                return await self._in_own_thread(loop, run_marked, _OVERFLOW)
            loop.run_in_executor(executor, self._run_on_pool, job)
            try:
                return await job.done
            finally:
                job.take()  # cancelled before it started: it never will
                with self._queued_lock:
                    self._queued.discard(job)

        if outer:  # a nested call begins: see the module doc
            self._unblock_queued()
        return load

    def _run_on_pool(self, job: _Job[Any]) -> None:
        """A pool thread's turn at ``job`` (it ran already if another thread took it)."""
        try:
            job.run()
        finally:
            with self._queued_lock:
                self._on_pool -= 1

    async def _in_own_thread(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[[], T], kind: str
    ) -> T:
        """``fn`` on a thread of its own (an overflow or a nested load), or
        ``LoaderThreadsExhausted``."""
        job = _Job(fn, loop)
        job.take()
        self._start_taken(job, kind)
        return await job.done

    def _start_taken(self, job: _Job[Any], kind: str) -> None:
        """Run ``job`` (taken) on a thread of its own, counted with its ``kind`` until
        the thread ends (not until its caller stops waiting: an abandoned loader still
        holds its thread, a nested one too once the loader it belonged to gave up on
        it). Each kind has its own cap: nested loads of a healthy database (every
        request's loader reading through the cache once more) never crowd out the
        overflow past the pool, nor the other way round."""
        # Nested ones: as many as the pool and its overflow may run loaders (each may
        # nest), never 0: with max_overflow=0 every nested call failed on an idle cache.
        cap = self._max_overflow if kind == _OVERFLOW else self._pool_size + self._max_overflow
        with self._queued_lock:
            if self._own[kind] >= cap:
                raise LoaderThreadsExhausted(
                    f"{self._pool_size} pool threads and {cap} {kind} loader threads are "
                    "all running loaders (a database that hangs?): this load fails rather "
                    "than start another thread (SyncLayeredCache(max_overflow=))"
                )
            self._own[kind] += 1
        try:
            threading.Thread(
                target=self._run_own, args=(job, kind), name=_THREAD_NAMES[kind], daemon=True
            ).start()
        except BaseException:
            self._own_done(kind)
            raise

    def _run_own(self, job: _Job[Any], kind: str) -> None:
        try:
            job.run_taken()
        finally:
            self._own_done(kind)

    def _own_done(self, kind: str) -> None:
        with self._queued_lock:
            self._own[kind] -= 1

    def _unblock_queued(self) -> None:
        with self._queued_lock:
            queued = list(self._queued)
        for job in queued:
            if not job.take():
                continue  # running already (on the pool, or unqueued by another call)
            try:
                self._start_taken(job, _NESTED)  # for a nested call: counted as one
            except Exception as exc:  # past max_overflow: it fails, as any load there
                job.fail(exc)


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
        if self.take():
            self.run_taken()

    def run_taken(self) -> None:
        """Run it: the caller has taken it (``take``)."""
        done = self.done
        try:
            result = self._fn()
        except BaseException as exc:  # handed to the awaiting task, not lost in the thread
            self._settle(functools.partial(done.set_exception, _carried(exc)))
        else:
            self._settle(functools.partial(done.set_result, result))

    def fail(self, error: Exception) -> None:
        """Fail it without running it: the caller has taken it (``take``)."""
        self._settle(functools.partial(self.done.set_exception, error))

    def _settle(self, outcome: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (close())
            self._loop.call_soon_threadsafe(_settle, self.done, outcome)


def _carried(error: BaseException) -> BaseException:
    """What a future can hold for ``error``: asyncio refuses ``StopIteration`` (its
    ``set_exception`` raises TypeError inside the loop's callback, and the future never
    settles: the call waited out its timeout holding the lease), as a coroutine's own
    would be turned into RuntimeError (PEP 479); a non-``Exception``: module doc."""
    if isinstance(error, StopIteration | StopAsyncIteration):
        carried = RuntimeError(f"the loader raised {type(error).__name__}")
        carried.__cause__ = error
        return carried
    return error if isinstance(error, Exception) else LoaderInterrupted(error)


def _call_marked(chain: tuple[str, ...], loader: Callable[[], T]) -> T:
    """``loader()`` in its context, marked as loading ``chain``; an awaitable where a
    value was due (an async function passed to the sync API) is a clear error, not a
    coroutine object cached as the value."""
    _CHAIN.set(chain)
    result = loader()
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited: no "coroutine was never awaited" warning
        raise TypeError(
            "the sync API's loader returned an awaitable: pass a plain function, or use "
            "LayeredCache (the async API) for async loaders"
        )
    return result


def _settle(future: asyncio.Future[Any], outcome: Callable[[], None]) -> None:
    if not future.done():
        outcome()
