"""A cache built in one process and started in processes forked from it: gunicorn
``--preload`` with uvicorn workers imports the app, and so builds the cache
(``from_config`` does no I/O), in the master. Every worker had the master's instance
id, the origin of its backplane entries: each worker's listener skipped the others'
entries as its own, and a write in one worker was never dropped from another's L1
(found by an adversarial review, 2026-12-05). A cache the master had *started* holds
the master's connections: a worker refuses to start it, with a clear error. A lock
another thread of the parent held at the fork is released in the child (``_forklock``)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from layered_cache import LayeredCache, _redact, prometheus
from layered_cache.http import ETags
from layered_cache.sync import SyncLayeredCache
from tests.helpers import CountingLoader, make_config

_NAMESPACES = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}


def _forked_worker(cache: LayeredCache, role: str, ready: Any, done: Any, out: Any) -> None:
    async def reader() -> None:
        async with cache:
            await cache.get_or_load("book", {"id": 1}, CountingLoader("old"))
            ready.set()
            while not done.is_set():  # noqa: ASYNC110 - a multiprocessing Event
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.5)  # ~100 x the backplane's latency
            _report(out, (role, cache.instance_id, await cache.get("book", {"id": 1})))

    async def writer() -> None:
        async with cache:
            while not ready.is_set():  # noqa: ASYNC110 - a multiprocessing Event
                await asyncio.sleep(0.02)
            await cache.set("book", {"id": 1}, "new")
            done.set()
            _report(out, (role, cache.instance_id, await cache.get("book", {"id": 1})))

    try:
        asyncio.run(reader() if role == "reader" else writer())
    except BaseException as exc:  # report, don't hang the parent
        _report(out, (role, "error", repr(exc)))
    os._exit(0)


def _report(out: Any, result: tuple[str, str, Any]) -> None:
    """Send the result and leave at once (the child's shutdown is not under test)."""
    out.put(result)
    out.close()
    out.join_thread()
    os._exit(0)


def test_workers_forked_from_a_preloaded_cache_hear_each_others_writes(
    redis_url: str, prefix: str
) -> None:
    """Broken: "invalidations drop it within the backplane's latency" / "after set()
    returns ... no copy written before it (L1 of any instance) is served beyond the L1
    bound" / the fork-safety claim.

    A LayeredCache built at import (``from_config`` does no I/O; the bookstore example
    builds it in ``create_app()``, started in the lifespan) and then forked (gunicorn
    ``--preload`` with uvicorn workers, multiprocessing fork) gives every worker the
    same ``instance_id``: the backplane origin. Each worker's listener then skips the
    others' entries as "our own invalidation: already applied locally".
    Observed: after worker W's set("new") returned, worker R keeps serving "old" from L1
    (for its whole 60 s L1 TTL). Expected: R reads "new" (or misses) within the
    backplane latency; each process must have its own origin (e.g. regenerate the id in
    start() / when os.getpid() differs from the builder's)."""
    config = make_config(redis_url, prefix, _NAMESPACES, backplane={"block": "200ms"})
    cache = LayeredCache.from_config(config)  # at import, in the master
    ctx = multiprocessing.get_context("fork")
    ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_forked_worker, args=(cache, role, ready, done, out))
        for role in ("reader", "writer")
    ]
    for proc in procs:
        proc.start()
    try:
        results = {role: (ident, value) for role, ident, value in (out.get(timeout=30) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert "error" not in {ident for ident, _ in results.values()}, results
    assert results["writer"][1] == "new"
    assert results["reader"][1] == "new", (
        f"reader worker still serves {results['reader'][1]!r} from L1 after the other "
        f"worker's set() returned; both workers' instance_id: "
        f"{results['reader'][0]} / {results['writer'][0]}"
    )


def _start_in_child(cache: LayeredCache, out: Any) -> None:
    async def start() -> None:
        try:
            await cache.start()
        except RuntimeError as exc:
            _report(out, ("child", "refused", str(exc)))
        _report(out, ("child", "started", ""))

    asyncio.run(start())


async def test_a_cache_started_before_the_fork_refuses_to_start_in_the_child(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, _NAMESPACES, backplane={"block": "200ms"})
    async with LayeredCache.from_config(config) as cache:
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_start_in_child, args=(cache, out))
        child.start()
        try:
            _, outcome, message = out.get(timeout=30)
        finally:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
        assert outcome == "refused", message
        assert f"started in process {os.getpid()}" in message and "per process" in message


# Locks a thread of the parent may hold at the fork: the loop thread recording a load
# time or an L2 read, a scrape copying the histograms or folding retired counters, a
# registration, a request tagging a response, a config remembering its secrets.
_HELD_AT_THE_FORK: dict[str, Callable[[prometheus.CacheCollector, ETags], Any]] = {
    "load-time histogram": lambda collector, _: collector.load_seconds._lock,
    "L2-read histogram": lambda collector, _: collector.l2_read_seconds._lock,
    "retired counters": lambda collector, _: collector._retired._lock,
    "collectors": lambda *_: prometheus._collectors_lock,
    "etags": lambda _, etags: etags._lock,
    "redaction": lambda *_: _redact._lock,
}


def _uses_everything(
    cache: SyncLayeredCache, registry: CollectorRegistry, etags: ETags, out: Any
) -> None:
    """In the child: each use in a thread of its own, given 5 s (a held lock: forever)."""
    steps: dict[str, Callable[[], object]] = {
        "load": lambda: cache.get_or_load("book", {"id": 2}, lambda: "child"),
        "scrape": lambda: generate_latest(registry) and "ok",
        "register": lambda: prometheus.register_cache(cache, registry) is not None,
        "etag": lambda: etags.of("book:2", "child") == etags.of("book:2", "child"),
        "redact": _masks_a_new_secret,
    }
    outcome: dict[str, object] = {}
    for name, step in steps.items():
        thread = threading.Thread(target=lambda n=name, f=step: outcome.update({n: f()}))
        thread.start()
        thread.join(5)
        outcome.setdefault(name, "still waiting after 5 s")
    _report(out, ("child", "outcome", outcome))


def _masks_a_new_secret() -> bool:
    # Whether the secret is masked, not the exact text: the process's other tests may
    # have made the redactor remember secrets that mask other words of it too.
    _redact.remember_secret("child-secret-7f3a")
    return "child-secret-7f3a" not in _redact.redact("password child-secret-7f3a")


@pytest.mark.parametrize("held", list(_HELD_AT_THE_FORK))
def test_a_child_forked_while_a_parent_thread_holds_a_lock_loads_and_is_scraped(
    redis_url: str, prefix: str, held: str
) -> None:
    """README, "Fork-safe": a cache started at import survives ``multiprocessing``
    (fork), a worker's ``/metrics`` counts its own requests. ``fork()`` copies a lock
    held by another thread of the parent (only the forking thread goes on in the
    child), so the child's first use of it waited forever: every load timed out, the
    scrape hung. The parent's thread is stood in for by holding the lock across the
    fork."""
    cache = SyncLayeredCache.from_config(make_config(redis_url, prefix), timeout=2)
    cache.start()
    try:
        registry, etags = CollectorRegistry(), ETags()
        collector = prometheus.register_cache(cache, registry)
        assert collector is not None
        assert cache.get_or_load("book", {"id": 1}, lambda: "parent") == "parent"
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_uses_everything, args=(cache, registry, etags, out))
        with _HELD_AT_THE_FORK[held](collector, etags):
            child.start()
        try:
            _, _, outcome = out.get(timeout=60)
        finally:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
        expected = {"load": "child", "scrape": "ok", "register": True, "etag": True, "redact": True}
        assert outcome == expected, f"held at the fork: {held}"
        # and the parent, its lock released, goes on
        assert cache.get_or_load("book", {"id": 3}, lambda: "parent") == "parent"
        assert b"layered_cache_load_seconds" in generate_latest(registry)
    finally:
        cache.close()


def _log_a_line(logger: Any, out: Any) -> None:
    logger.msg("from the child")  # blocked forever with the write lock copied held
    _report(out, ("child", "logged", ""))


def test_a_logger_cached_before_the_fork_writes_in_a_child_forked_mid_write(
    tmp_path: Any,
) -> None:
    """README, "Fork-safe": structlog's per-file write lock (its default loggers take it
    around each line) held by a parent thread at the fork is released in the child, for
    a logger cached before the fork too (``cache_logger_on_first_use``: it keeps the
    lock object itself, so a new lock in structlog's table would not reach it). Without
    it the child's loop thread blocked at its first log line: its cache never started
    (tests/test_django_backend.py has the whole scenario)."""
    from structlog import PrintLogger, _output

    with (tmp_path / "log").open("w") as file:
        logger = PrintLogger(file)
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_log_a_line, args=(logger, out))
        with _output.WRITE_LOCKS[file]:  # stands in for the parent's thread mid-write
            child.start()
        try:
            assert out.get(timeout=20)[1] == "logged"
        finally:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
