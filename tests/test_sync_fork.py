"""The sync API under pre-forking servers: a cache started before a fork (gunicorn
--preload, multiprocessing) works in the child, and no call waits forever."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layered_cache.sync import DEFAULT_TIMEOUT, SyncLayeredCache, SyncTimeoutError
from tests.helpers import make_config
from tests.servers import free_port

ROOT = Path(__file__).parent.parent


@pytest.fixture
def cache(redis_url: str, prefix: str) -> Iterator[SyncLayeredCache]:
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as sync_cache:
        yield sync_cache


def _get(url: str, timeout: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


@contextlib.contextmanager
def _serving(command: list[str], port: int, env: dict[str, str], log_path: Path) -> Iterator[str]:
    """Run a WSGI server (the app: tests/apps/wsgi_books.py); yield its base URL once it
    answers."""
    with log_path.open("wb") as log:  # a file, not a pipe: nobody drains a pipe here
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    _get(f"{base}/loads", timeout=1)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{log_path.stem} did not start:\n{log_path.read_text()}"
                        ) from None
                    time.sleep(0.1)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def _gunicorn(workers: int, redis_url: str, prefix: str, tmp_path: Path) -> Iterator[str]:
    """gunicorn --preload serving tests/apps/wsgi_books.py; yields its base URL."""
    port = free_port()
    env = {**os.environ, "LC_REDIS_URL": redis_url, "LC_PREFIX": prefix}
    command = [sys.executable, "-m", "gunicorn", "--preload", "-w", str(workers),
               "--timeout", "30", "-b", f"127.0.0.1:{port}", "tests.apps.wsgi_books:app"]  # fmt: skip
    with _serving(command, port, env, tmp_path / "gunicorn.log") as base:
        yield base


@pytest.fixture
def gunicorn_preload(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[str]:
    with _gunicorn(2, redis_url, prefix, tmp_path) as base:
        yield base


@pytest.fixture
def gunicorn_preload_one_worker(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[str]:
    """One worker: every request, ``/metrics`` included, is answered by the same one."""
    with _gunicorn(1, redis_url, prefix, tmp_path) as base:
        yield base


@pytest.fixture
def uwsgi_prefork(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[str]:
    """uWSGI, master + 2 workers, the app loaded in the master then forked (its default,
    like --preload), with the two options README asks for. Not in the dev extra (a C
    build): skipped unless installed."""
    uwsgi = Path(sys.executable).with_name("uwsgi")
    if not uwsgi.exists():
        pytest.skip("uwsgi is not installed (pip install uwsgi)")
    port = free_port()
    env = {**os.environ, "LC_REDIS_URL": redis_url, "LC_PREFIX": prefix}
    venv = Path(sys.executable).parent.parent
    command = [str(uwsgi), "--http-socket", f"127.0.0.1:{port}", "--master",
               "--processes", "2", "--enable-threads", "--py-call-osafterfork",
               "--need-app", "--die-on-term",
               "--chdir", str(ROOT), "-H", str(venv), "--module", "tests.apps.wsgi_books:app"]  # fmt: skip
    with _serving(command, port, env, tmp_path / "uwsgi.log") as base:
        yield base


def test_gunicorn_preload_worker_serves_requests_after_fork(
    gunicorn_preload: str, redis_url: str, prefix: str
) -> None:
    started = time.monotonic()
    answers = [_get(f"{gunicorn_preload}/book/42") for _ in range(20)]
    assert [a["value"] for a in answers] == ["v1"] * 20
    assert time.monotonic() - started < 10  # no request waited for a timeout
    # the master warmed book 0 before forking; workers read it from L2, not a hang
    assert _get(f"{gunicorn_preload}/book/0")["value"] == "master"


def test_gunicorn_preload_worker_follows_invalidations_after_fork(
    gunicorn_preload: str, redis_url: str, prefix: str
) -> None:
    assert _get(f"{gunicorn_preload}/book/7")["value"] == "v1"  # now in a worker's L1 (1 m)
    with SyncLayeredCache.from_config(
        make_config(redis_url, prefix, {"book": {"key": "book:{id}"}})
    ) as other:
        other.set("book", {"id": 7}, "v2")
    # the child's own backplane listener drops its L1 copy: every worker sees v2
    deadline = time.monotonic() + 10
    while _get(f"{gunicorn_preload}/book/7")["value"] != "v2":
        assert time.monotonic() < deadline, "a worker kept serving the invalidated value"
        time.sleep(0.05)
    assert all(_get(f"{gunicorn_preload}/book/7")["value"] == "v2" for _ in range(10))


def test_gunicorn_preload_workers_return_the_declared_type_on_an_l2_hit(
    gunicorn_preload: str,
) -> None:
    """README: the return annotation of a function ``@cache.cached`` declares the value
    type; DESIGN.md: "A call returns the same type whichever layer answered it". The
    master declared it at import and warmed book 1 into L2. Each worker builds its own
    cache after the fork, which was built without the declared type: its L2 hit came
    back as a dict, and the view's ``book.title`` an AttributeError."""
    answers = [_get(f"{gunicorn_preload}/typed/1") for _ in range(10)]
    assert {answer["type"] for answer in answers} == {"Book"}


def test_gunicorn_preload_worker_metrics_count_the_workers_own_loads(
    gunicorn_preload_one_worker: str,
) -> None:
    """docs/metrics.md: register the sync cache's ``.cache`` at import, scraped in each
    worker. The collector held the master's inner cache, which the worker never uses:
    its ``/metrics`` showed the master's counters frozen at the fork (its one load),
    whatever the worker did, and the load histogram never moved. It follows the sync
    cache to the worker's own now."""
    for book_id in (2, 3, 4):
        _get(f"{gunicorn_preload_one_worker}/book/{book_id}")  # three loads in the worker
    with urllib.request.urlopen(f"{gunicorn_preload_one_worker}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    assert float(samples['layered_cache_loads_total{namespace="book"}']) == 3  # not the master's
    # the histogram's hooks went on with the cache
    assert float(samples['layered_cache_load_seconds_count{namespace="book",outcome="ok"}']) == 3


def _child_reads(cache: SyncLayeredCache, results: Any) -> None:
    first = cache.get("book", {"id": 1})
    loaded = cache.get_or_load("book", {"id": 2}, lambda: "loaded-in-child")
    results.put((os.getpid(), first, loaded, threading.current_thread().name))


def test_multiprocessing_fork_child_uses_a_cache_started_in_the_parent(
    cache: SyncLayeredCache,
) -> None:
    cache.set("book", {"id": 1}, "from-parent")
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child_reads, args=(cache, results))
    child.start()
    child.join(15)
    assert child.exitcode == 0, "the child hung or failed"
    pid, first, loaded, _ = results.get(timeout=1)
    assert pid != os.getpid()
    assert (first, loaded) == ("from-parent", "loaded-in-child")
    # the parent's loop was left alone by the child: it still serves, from L2 too
    assert cache.get("book", {"id": 2}) == "loaded-in-child"
    assert cache.get_or_load("book", {"id": 3}, lambda: "parent") == "parent"


def test_forked_child_does_not_serve_the_l1_it_inherited(cache: SyncLayeredCache) -> None:
    cache.set("book", {"id": 5}, "old")  # in the parent's L1, copied into the child
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    written = context.Event()

    def child() -> None:
        written.wait(10)  # the parent overwrote the key after the fork
        results.put(cache.get("book", {"id": 5}))

    process = context.Process(target=child)
    process.start()
    cache.set("book", {"id": 5}, "new")
    written.set()
    process.join(15)
    assert process.exitcode == 0
    assert results.get(timeout=1) == "new"  # not the copied L1's "old"


def test_a_call_that_outlives_the_timeout_raises_naming_the_call(
    redis_url: str, prefix: str
) -> None:
    with SyncLayeredCache.from_config(make_config(redis_url, prefix), timeout=0.3) as cache:
        started = time.monotonic()
        with pytest.raises(SyncTimeoutError, match=r"get_or_load\('book'\).*0\.3 s"):
            cache.get_or_load("book", {"id": 1}, lambda: time.sleep(3))
        assert time.monotonic() - started < 2
        assert isinstance(SyncTimeoutError(), TimeoutError)
        assert cache.get_or_load("book", {"id": 2}, lambda: "fine") == "fine"  # still usable


def test_sync_calls_have_a_finite_default_timeout(cache: SyncLayeredCache) -> None:
    assert cache._timeout == DEFAULT_TIMEOUT and 0 < DEFAULT_TIMEOUT < 30  # < gunicorn's


def test_the_fork_hook_does_not_keep_a_closed_cache_alive(redis_url: str, prefix: str) -> None:
    sync_cache = SyncLayeredCache.from_config(make_config(redis_url, prefix))
    sync_cache.start()
    sync_cache.close()
    ref = weakref.ref(sync_cache)
    del sync_cache
    gc.collect()
    assert ref() is None


def test_a_new_cache_does_not_miss_an_invalidation_right_after_its_first_fill(
    redis_url: str, prefix: str, cache: SyncLayeredCache
) -> None:
    # A forked worker starts its cache on its first request and fills L1 at once: the
    # backplane listener must already know where to read from, or this set is missed.
    for attempt in range(5):
        cache.set("book", {"id": attempt}, "old")
        with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as fresh:
            assert fresh.get("book", {"id": attempt}) == "old"  # in fresh's L1 (5 s)
            cache.set("book", {"id": attempt}, "new")
            deadline = time.monotonic() + 3
            while fresh.get("book", {"id": attempt}) != "new":
                assert time.monotonic() < deadline, f"missed the invalidation ({attempt})"
                time.sleep(0.02)


def test_a_fork_the_hook_did_not_see_is_caught_on_the_next_call(
    cache: SyncLayeredCache,
) -> None:
    # A server that forks without running Python's at-fork hooks: the loop thread seen
    # from here belongs to another pid, so the next call builds this process's own.
    inherited = cache._runner
    assert inherited is not None
    inherited.pid = -1  # as if started by the parent
    try:
        assert cache.get_or_load("book", {"id": 9}, lambda: "rebuilt") == "rebuilt"
        assert cache._runner is not inherited and cache._runner is not None
        assert cache._runner.owned_here
    finally:
        inherited.pid = os.getpid()
        inherited.stop()


def test_a_cache_started_with_redis_down_waits_a_bounded_time_then_serves(prefix: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    with SyncLayeredCache.from_config(make_config(url, prefix)) as cache:
        waited = time.monotonic() - started
        assert cache.get_or_load("book", {"id": 1}, lambda: "from-db") == "from-db"
    assert waited < 2 * (0.2 + 0.2) + 1.0  # 2 x (connect_timeout + timeout) + slack


def test_uwsgi_worker_serves_requests_and_follows_invalidations_after_fork(
    uwsgi_prefork: str, redis_url: str, prefix: str
) -> None:
    answers = [_get(f"{uwsgi_prefork}/book/42") for _ in range(20)]
    assert [a["value"] for a in answers] == ["v1"] * 20
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as other:
        other.set("book", {"id": 42}, "v2")
    deadline = time.monotonic() + 10
    while _get(f"{uwsgi_prefork}/book/42")["value"] != "v2":
        assert time.monotonic() < deadline, "a worker kept serving the invalidated value"
        time.sleep(0.05)
