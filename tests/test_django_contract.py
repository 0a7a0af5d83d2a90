"""``get_or_set``, ``add``, ``incr`` and ``touch`` held to Django's contract where
adversarial reviews found them off: an ``incr`` excludes every other, a ``set`` racing it
or not; a present value is returned whatever the timeout; the timeout
counts from when the value is stored, after ``default`` ran (or, for ``add`` and
``touch``, after the wait for the key's lease); a value another process set while
``default`` ran is never deleted; ``add()`` of a value too large to store returns
False; a default's database connection gets Django's upkeep on its loader thread. Each
test failed on the code before the fix."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests import djangoconf

djangoconf.configure()

from django.core.cache.backends.locmem import LocMemCache  # noqa: E402

import layered_cache.django as django_backend  # noqa: E402
from layered_cache._django_setup import close_shared  # noqa: E402
from layered_cache._keys import lease_name  # noqa: E402
from layered_cache.django import LayeredCacheBackend  # noqa: E402


def backend(redis_url: str, prefix: str, **options: Any) -> LayeredCacheBackend:
    """As tests/test_django_backend.py builds one: distinct options, distinct process."""
    config = options.pop("config", {})
    section = config.setdefault("redis", {})
    section.update({"url": redis_url, "prefix": prefix})
    section.setdefault("timeout", "3s")
    section.setdefault("connect_timeout", "3s")
    return LayeredCacheBackend("", {"OPTIONS": {"config": config, **options}})


@pytest.fixture(autouse=True)
def _close_shared() -> Iterator[None]:
    yield
    close_shared()


@pytest.mark.parametrize("timeout", [0, -1])
def test_get_or_set_with_timeout_zero_returns_the_cached_value_when_the_key_exists(
    redis_url: str, prefix: str, timeout: int
) -> None:
    """Was broken: Django's get_or_set contract ("Fetch a given key from the cache. If the
    key does not exist, add the key and set it to the default value"; BaseCache.get_or_set
    reads first and only falls back to default on a miss, whatever the timeout).
    Observed: with timeout=0 (or negative) the backend returns ``default`` without
    reading, although the key holds a value. Expected (LocMemCache, Django's RedisCache):
    the cached value. Cause: django.py:LayeredCacheBackend.get_or_set short-circuits
    ``expires_at <= now`` before looking the key up."""
    reference = LocMemCache(f"ref-{prefix}", {})
    reference.set("answer", "cached")
    assert reference.get_or_set("answer", "default", timeout=timeout) == "cached"

    cache = backend(redis_url, prefix)
    cache.set("answer", "cached")
    assert cache.get_or_set("answer", "default", timeout=timeout) == "cached"
    assert cache.get_or_set("answer", lambda: "default", timeout=timeout) == "cached"


def test_get_or_set_timeout_counts_from_when_the_value_is_stored_not_before_default_runs(
    redis_url: str, prefix: str
) -> None:
    """Was broken: Django's timeout contract ("the number of seconds the value should be
    stored in the cache") and docs/django.md ("get_or_set ... a missing key calls
    `default` once"; "Every entry carries its own expiry (Django's absolute
    `now + timeout`)"). Observed: the expiry is stamped *before* ``default`` runs, so a
    default taking 0.7 s with timeout=1 leaves an entry that dies 0.3 s after it was
    stored, and a default slower than the timeout is called twice by one get_or_set and
    caches nothing. Expected (any Django backend: add() after default()): one call, the
    value readable for ~timeout seconds after get_or_set returns. Cause:
    django.py:LayeredCacheBackend.get_or_set computes ``expires_at`` once, before
    ``sync_cache.get_or_load``, and reloads when the fresh entry is already past it."""
    cache = backend(redis_url, prefix)
    calls: list[float] = []

    def slow_default() -> str:
        calls.append(time.monotonic())
        time.sleep(0.7)
        return "report"

    assert cache.get_or_set("report", slow_default, timeout=1) == "report"
    time.sleep(0.4)  # 0.4 s after it was stored with timeout=1
    assert cache.get("report") == "report", "the entry died before its timeout"

    calls.clear()

    def slower_than_timeout() -> str:
        calls.append(time.monotonic())
        time.sleep(1.2)
        return "slow"

    assert cache.get_or_set("slow", slower_than_timeout, timeout=1) == "slow"
    assert len(calls) == 1, f"one get_or_set called default {len(calls)} times"


def test_add_of_a_value_too_large_to_cache_returns_false_and_admits_no_second_adder(
    redis_url: str, prefix: str
) -> None:
    """Was broken: Django's add() contract ("returns True if the value was stored, False
    otherwise"), the docs' "of 20 concurrent adders ... exactly one gets True", and
    docs/django.md's own rule for oversized values ("not cached ... as memcached does":
    memcached's add of such a value returns False; set_many here reports the key as
    failed). Observed: add() of a value over max_value_bytes stores nothing and returns
    True, so every later adder also gets True (an add-as-lock admits everyone).
    Expected: False (not stored). Cause: django.py:LayeredCacheBackend.add's step ignores
    ``write()``'s result (_django_setup.write returns False for a value too large)."""
    cache = backend(redis_url, prefix)
    big = b"x" * 2_000_000
    assert cache.set_many({"big": big}) == ["big"]  # set_many says: not inserted
    first = cache.add("lock", big, 30)
    second = cache.add("lock", big, 30)
    assert not cache.has_key("lock")
    assert (first, second) == (False, False), (
        f"add() returned {first}, then {second}, storing nothing either time"
    )


def test_a_get_or_set_default_using_the_orm_recovers_after_its_db_connection_breaks(
    redis_url: str, prefix: str, tmp_path: Any
) -> None:
    """Was broken: docs/django.md ("`default` runs on a loader thread: a Django ORM call
    there uses that thread's own DB connection") meets Django's connection contract
    ("Django closes the connection once it exceeds the maximum age defined by
    CONN_MAX_AGE or when it isn't usable any longer", run by close_old_connections on
    request_started/request_finished, in the request's thread only). Observed: the
    connection a default opens on a loader thread is never closed (CONN_MAX_AGE=0 is
    ignored: one persistent connection per loader thread, up to max_workers=32 per
    worker), and once the database drops it (restart, failover, idle timeout) every
    later get_or_set miss whose default runs on that thread fails, request after
    request, while the same query in the view recovers at the next request. Expected:
    the default's queries recover as the view's do. Cause: _sync_loaders / sync.py run
    defaults on long-lived pool threads with no Django connection lifecycle
    (django.py:LayeredCacheBackend.get_or_set gives Django no hook: e.g. call
    ``django.db.close_old_connections()`` around each default on the loader thread)."""
    from django.core.signals import request_finished, request_started
    from django.db import connections

    path = str(tmp_path / "scratch.sqlite3")
    connections.settings["scratch"] = connections.configure_settings(
        {
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            "scratch": {"ENGINE": "django.db.backends.sqlite3", "NAME": path},
        }
    )["scratch"]
    opened: list[Any] = []

    def query() -> int:
        conn = connections["scratch"]
        with conn.cursor() as cursor:
            cursor.execute("select 1")
        opened.append(conn)
        return 1

    cache = backend(redis_url, prefix)
    try:
        request_started.send(sender=None)
        assert query() == 1  # the view's own query: the request thread's connection
        assert cache.get_or_set("first", query, 60) == 1  # the default: loader thread
        request_finished.send(sender=None)  # Django's close_old_connections, CONN_MAX_AGE=0
        still_open = [c for c in opened if c.connection is not None]
        for conn in opened:  # the database drops them (restart, failover, idle kill)
            if conn.connection is not None:
                conn.connection.close()
        failures = []
        for i in range(3):  # three later requests
            request_started.send(sender=None)
            try:
                assert query() == 1  # in the view: fine, Django reconnected
                cache.get_or_set(f"miss{i}", query, 60)
            except Exception as exc:  # the failure is what is checked
                failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                request_finished.send(sender=None)
        assert not still_open and not failures, (
            f"{len(still_open)} loader-thread connection(s) outlived request_finished; "
            f"later defaults failed: {failures}"
        )
    finally:
        for conn in opened:
            if conn.connection is not None:
                conn.connection = None
        del connections.settings["scratch"]


def test_a_set_from_another_process_during_a_slow_get_or_set_is_not_deleted(
    redis_url: str, prefix: str
) -> None:
    """Was broken: Django's get_or_set only *adds* (BaseCache.get_or_set: default, then
    add(), which never replaces a present value), and README "Invalidation wins
    everywhere ... After ... set() returns" the value set is what is served. Observed:
    process B runs get_or_set("k", default, timeout=1) whose default takes 1.2 s; while
    it runs, process A does set("k", "newer", 60) and returns. B's get_or_set finds its
    own loaded entry already expired (expiry stamped before the load), calls
    ``invalidate`` on the key, which deletes A's fresh value in L2 and every L1, loads
    again (default called twice) and stores nothing: afterwards both processes read
    None. Expected: A's value survives (get returns "newer" in both processes); at most
    B's get_or_set returns its default. Cause: django.py:LayeredCacheBackend.get_or_set,
    the "past its own timeout ... drop it, load again" branch (``sync_cache.invalidate``)
    applied to an entry that is not the one in the cache."""
    process_a = backend(redis_url, prefix)
    process_b = backend(redis_url, prefix, timeout=19.0)
    process_a.get("warm-up")
    process_b.get("warm-up")

    def slow_default() -> str:
        time.sleep(1.2)
        return "from-default"

    loading = threading.Thread(target=lambda: process_b.get_or_set("k", slow_default, 1))
    loading.start()
    time.sleep(0.3)
    process_a.set("k", "newer", 60)
    loading.join(10)
    time.sleep(0.2)
    assert (process_a.get("k"), process_b.get("k")) == ("newer", "newer")


def _plant_lease(redis_url: str, cache: LayeredCacheBackend, key: str, ms: int) -> None:
    """The key's lease as a process that crashed mid-``get_or_set`` leaves it (it
    expires by itself after ``ms``)."""
    name = lease_name(cache.layered.key("django", cache.key_fields(key)))
    with redis.Redis.from_url(redis_url) as client:
        assert client.set(name, "crashed-process-token", px=ms, nx=True)


def test_an_add_that_waited_for_the_keys_lease_stores_its_value_and_admits_no_second_adder(
    redis_url: str, prefix: str
) -> None:
    """Was broken: docs/django.md, ``add``: "under the key's lease: read L2; if absent
    or expired, write ... of 20 concurrent adders ... exactly one gets True"; a caller
    that can't get the lease at once waits for it (up to ``lease_ttl`` + 1 s).
    Observed: with a crashed process's lease on the key (1.5 s left), ``add("job-lock",
    "A", timeout=1)`` waited, returned True, and stored nothing; a second adder got True
    too. Cause: django.py:LayeredCacheBackend.add stamped the expiry (now + 1 s) before
    ``_django_locked.locked`` waited; written after the wait, the entry was already
    expired, so ``_django_setup.write`` deleted the key ("gone at once") and said True.
    Now the expiry is stamped in the locked step."""
    first, second = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    _plant_lease(redis_url, first, "job-lock", 1500)
    assert first.add("job-lock", "A", timeout=1) is True
    assert (first.get("job-lock"), second.add("job-lock", "B", timeout=1)) == ("A", False)


def test_a_touch_that_waited_for_the_keys_lease_keeps_the_value_for_its_timeout(
    redis_url: str, prefix: str
) -> None:
    """Was broken: docs/django.md, ``touch``: "under the key's lease: read, rewrite
    with the new expiry" (Django: a new expiration, True if touched). Observed: "page"
    set for 60 s, a crashed process's lease on it (1.5 s left); ``touch("page", 1)``
    waited, returned True, and the value was gone at once. Cause: as for ``add``, the
    expiry stamped before the wait, so the rewrite was already expired and deleted the
    key."""
    cache = backend(redis_url, prefix)
    cache.set("page", "v", timeout=60)
    _plant_lease(redis_url, cache, "page", 1500)
    assert cache.touch("page", timeout=1) is True
    assert cache.get("page") == "v"


def test_a_touch_behind_a_slow_get_or_set_of_another_process_keeps_its_value(
    redis_url: str, prefix: str
) -> None:
    """Was broken: as above, with the lease holder the docs name ("a ``get_or_set``
    loader holding it"). Observed: process A's ``get_or_set("report", default, 60)``
    with a slow default holds the lease; process B's ``touch("report", 1)`` waits for
    it, then returns True and deletes the 60 s value A just stored. Expected: touch
    False (it read before the store) or True with the value alive for its second."""
    a, b = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    started, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def default() -> str:
        started.set()
        assert release.wait(10)
        return "report"

    def load() -> None:
        results["a"] = a.get_or_set("report", default, timeout=60)

    def touch() -> None:
        results["touch"] = b.touch("report", timeout=1)

    loader, toucher = threading.Thread(target=load), threading.Thread(target=touch)
    loader.start()
    assert started.wait(5)
    toucher.start()
    time.sleep(1.3)  # the touch is waiting for the lease the loader holds
    release.set()
    loader.join(10)
    toucher.join(10)
    assert results["a"] == "report"
    assert results["touch"] is False or b.get("report") == "report", results


def test_an_incr_after_a_counter_reset_waits_for_an_incr_that_straddled_the_reset(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was broken: docs/django.md, ``incr``: "atomic as ``add``", i.e. "atomic with
    every other ``add``/``incr``/``decr``/``touch`` of the key, in any process ... A
    plain ``set`` or ``delete`` racing it is ordered like any two writes (last wins)".
    Observed: a counter at 0; process A's ``incr`` has read 0 and is about to write;
    process B resets it (``set("hits", 100)``); process C's ``incr``, started after the
    reset returned, did not wait for A: it read 100 and wrote 101, then A wrote 1: C's
    increment, reported done, was lost. Expected: C waits for A (A and the reset race:
    last wins, A's 1 here), then reads 1 and writes 2. Cause: ``set()`` revokes the
    key's lease (``{key}:lease``, so a fill in flight can't land after it), and
    ``_django_locked.locked`` used that lease as the incr/add/touch lock; now it holds
    ``{key}:lock`` too, which no write revokes."""
    a = backend(redis_url, prefix)
    b = backend(redis_url, prefix, timeout=19.0)
    c = backend(redis_url, prefix, timeout=18.0)
    a.set("hits", 0, timeout=None)
    real_write = django_backend.write
    holding, release = threading.Event(), threading.Event()
    gated = [True]

    async def gated_write(*args: Any) -> bool:
        if gated[0]:  # the first write from here on: A's incr, holding the lock
            gated[0] = False
            holding.set()
            await asyncio.to_thread(release.wait, 10)
        return await real_write(*args)

    monkeypatch.setattr(django_backend, "write", gated_write)
    answers: dict[str, Any] = {}
    first = threading.Thread(target=lambda: answers.__setitem__("a", a.incr("hits")))
    first.start()
    assert holding.wait(5)  # A: lock held, 0 read, its write not yet sent
    b.set("hits", 100, timeout=None)  # the reset
    second = threading.Thread(target=lambda: answers.__setitem__("c", c.incr("hits")))
    second.start()
    second.join(0.5)  # C must be waiting for A's lock here
    c_waited_for_a = second.is_alive()
    release.set()
    first.join(10)
    second.join(10)
    final = backend(redis_url, prefix, timeout=17.0).get("hits")
    assert (c_waited_for_a, answers, final) == (True, {"a": 1, "c": 2}, 2)
