"""The sync API's life around its loop thread: what goes on from one inner cache to the
next when close() + start() builds a new one (a forked worker's: tests/test_sync_fork.py),
and what close() leaves behind for the process's exit."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from layered_cache import instrument
from layered_cache.prometheus import register_cache
from layered_cache.sync import SyncLayeredCache
from tests.helpers import make_config
from tests.test_metrics import FakeTracer

ROOT = Path(__file__).parent.parent


class Book(msgspec.Struct):
    id: int
    title: str


def test_a_sync_cached_function_keeps_its_declared_type_after_close_and_start(
    redis_url: str, prefix: str
) -> None:
    """DESIGN.md: "A call returns the same type whichever layer answered it". A test
    suite's setup and teardown, a reload: ``start()`` after ``close()`` builds a new
    inner cache, which was built without the type ``@cache.cached`` declared, and its
    L2 hits came back as dicts."""
    cache = SyncLayeredCache.from_config(make_config(redis_url, prefix))
    cache.start()
    try:

        @cache.cached("book")
        def book_detail(id: int) -> Book:
            return Book(id=id, title="Emma")

        assert book_detail(1) == Book(id=1, title="Emma")  # loaded, now in L2
        cache.close()
        cache.start()
        assert book_detail(1) == Book(id=1, title="Emma")  # an L2 hit of the new cache
    finally:
        cache.close()


@pytest.mark.parametrize(
    "registered",
    [lambda sync_cache: sync_cache, lambda sync_cache: sync_cache.cache],
    ids=["the sync cache", "its inner cache"],
)
def test_metrics_and_traces_go_on_with_the_cache_built_after_close_and_start(
    redis_url: str, prefix: str, registered: Callable[[SyncLayeredCache], Any]
) -> None:
    """docs/metrics.md: register the sync cache (or its ``.cache``) once. The collector
    held the inner cache, which ``close()`` let go: after ``start()`` the new one's
    loads were neither counted nor timed nor traced."""
    registry, tracer = CollectorRegistry(), FakeTracer()
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        register_cache(registered(cache), registry)
        instrument(registered(cache), tracer)
        cache.close()
        cache.start()
        cache.get_or_load("book", {"id": 1}, lambda: "v")
        loads = registry.get_sample_value("layered_cache_loads_total", {"namespace": "book"})
        labels = {"namespace": "book", "outcome": "ok"}
        timed = registry.get_sample_value("layered_cache_load_seconds_count", labels)
    assert (loads, timed, len(tracer.spans)) == (1, 1, 1)

# A script that meets a database that hangs: its call times out, it closes the cache and
# has nothing left to do.
_EXIT_AFTER_A_HUNG_LOADER = """
import os, time
from layered_cache.sync import SyncLayeredCache, SyncTimeoutError
from tests.helpers import make_config

cache = SyncLayeredCache.from_config(
    make_config(os.environ["LC_REDIS_URL"], os.environ["LC_PREFIX"]), timeout=0.5
)
cache.start()
try:
    cache.get_or_load("book", {"id": 1}, lambda: time.sleep(60) or "v")
except SyncTimeoutError:
    pass
cache.close()
print("closed", flush=True)
"""


def test_a_process_exits_after_close_while_a_loader_its_caller_gave_up_on_still_hangs(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """README: "No call waits forever", and a caller that times out leaves its loader
    running. The pool's threads were a ``ThreadPoolExecutor``'s, which the interpreter
    joins at exit: a management command that met a hung database was told after its
    timeout, closed the cache, and then hung at exit as long as the database did. They
    are daemon threads now, like the overflow and nested loaders' threads."""
    script = tmp_path / "exit_after_hung_loader.py"
    script.write_text(_EXIT_AFTER_A_HUNG_LOADER)
    env = {**os.environ, "LC_REDIS_URL": redis_url, "LC_PREFIX": prefix, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"still running {time.monotonic() - started:.0f} s on: {output[-300:]!r}")
    assert proc.returncode == 0 and b"closed\n" in output, output[-500:]


async def test_instrument_during_a_sync_caches_rebuild_keeps_the_span(
    late_replies: Any, prefix: str
) -> None:
    """_tracing.instrument: "A SyncLayeredCache (or its .cache) keeps the wrapper on every
    inner cache it builds"; the brief of ``_sync_inner``: "a hook added to one is on all".
    Scenario: one thread's first call builds the inner cache (its start takes a while: a
    Redis with some latency) while another thread instruments the sync cache (a framework's
    startup hook). Expected: the loads after are traced. Actual: ``InnerCaches.open``
    (layered_cache/_sync_inner.py:67-72) copies ``load_wrapper`` from ``self.hooks`` before
    ``await cache.start()`` and replaces ``self.hooks`` after it: a wrapper set on
    ``sync_cache.hooks`` meanwhile (the old Hooks) is dropped. The observer lists are shared
    and survive; the wrapper, a plain attribute, does not."""
    late_replies.latency = 0.05  # every reply 50 ms late: start() takes several of them
    tracer = FakeTracer()
    sync_cache = SyncLayeredCache.from_config(
        make_config(late_replies.url, prefix, redis={"timeout": "2s", "connect_timeout": "2s"})
    )
    try:
        starting = asyncio.ensure_future(asyncio.to_thread(sync_cache.start))
        await asyncio.sleep(0.15)  # the inner cache is being built
        assert not starting.done(), "start() ended too early to race"
        assert instrument(sync_cache, tracer)
        await starting
        await asyncio.to_thread(sync_cache.get_or_load, "book", {"id": 1}, lambda: "v")
    finally:
        await asyncio.to_thread(sync_cache.close)
    assert len(tracer.spans) == 1, "the span wrapper was lost by the rebuild"


async def test_instrument_during_a_sync_start_that_times_out_survives_the_retry(
    late_replies: Any, prefix: str
) -> None:
    """9c5db4a. Scenario: the first start() of a sync cache is slow (Redis 200 ms late per
    reply) and hits the facade's timeout; meanwhile another thread instruments the cache
    (a framework's startup hook: ``sync_cache.hooks`` is the new inner cache's Hooks by
    then). The app retries start() once Redis is quick again. Expected: the loads after
    are traced (``instrument``: "keeps the wrapper on every inner cache it builds").
    Actual: ``InnerCaches.open``'s rollback (layered_cache/_sync_inner.py:76-78) puts the
    old Hooks back, without the wrapper set on the new one meanwhile; the retry copies the
    old one's ``load_wrapper`` (None): no span."""
    from layered_cache import instrument
    from layered_cache.sync import SyncLayeredCache, SyncTimeoutError
    from tests.test_metrics import FakeTracer

    late_replies.latency = 0.2
    tracer = FakeTracer()
    sync_cache = SyncLayeredCache.from_config(
        make_config(late_replies.url, prefix, redis={"timeout": "2s", "connect_timeout": "2s"}),
        timeout=0.6,
    )
    try:
        starting = asyncio.ensure_future(asyncio.to_thread(sync_cache.start))
        await asyncio.sleep(0.3)  # the inner cache is being built
        assert not starting.done(), "start() ended too early to race"
        assert instrument(sync_cache, tracer)
        try:
            await starting
        except SyncTimeoutError:
            pass
        else:
            raise AssertionError("the first start() did not time out")
        late_replies.latency = 0.0
        await asyncio.to_thread(sync_cache.start)
        await asyncio.to_thread(sync_cache.get_or_load, "book", {"id": 1}, lambda: "v")
    finally:
        await asyncio.to_thread(sync_cache.close)
    assert len(tracer.spans) == 1, "the span wrapper set during the failed start was lost"
