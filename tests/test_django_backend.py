"""The Django backend as Django apps use it: coherent L1 across processes, one call of
``get_or_set``'s default per key, exact timeouts, pickle-free values, a scoped clear()."""

from __future__ import annotations

import asyncio
import datetime
import decimal
import multiprocessing
import os
import pickle
import select
import socket
import sys
import threading
import time
import uuid
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from tests import djangoconf
from tests.servers import RedisServer

djangoconf.configure()

from django.http import HttpResponse  # noqa: E402
from django.utils.safestring import SafeString, mark_safe  # noqa: E402

from layered_cache import ConfigError, L2Unavailable  # noqa: E402
from layered_cache._django_setup import close_shared  # noqa: E402
from layered_cache._logs import reset_logging  # noqa: E402
from layered_cache.django import LayeredCacheBackend, UncacheableValue  # noqa: E402
from layered_cache.sync import SyncTimeoutError  # noqa: E402


def backend(redis_url: str, prefix: str, **options: Any) -> LayeredCacheBackend:
    """A backend as Django builds it from CACHES; distinct ``options`` give a distinct
    shared cache (own L1 and backplane listener): a second process, in effect."""
    config = options.pop("config", {})
    # Patient timeouts: these scenarios are about Django's cache semantics, not latency,
    # and a starved CPU (make test-stress) once timed a read out at the default.
    section = config.setdefault("redis", {})
    section.update({"url": redis_url, "prefix": prefix})
    section.setdefault("timeout", "3s")
    section.setdefault("connect_timeout", "3s")
    return LayeredCacheBackend(
        options.pop("location", ""), {"OPTIONS": {"config": config, **options}}
    )


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _close_shared() -> Iterator[None]:
    yield
    close_shared()


@pytest.mark.filterwarnings("ignore::django.core.cache.CacheKeyWarning")
def test_readable_keys_stay_readable_in_redis_and_others_are_hashed(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    cache = backend(redis_url, prefix)
    cache.set("answer", 42)
    cache.set("key with spaces", 1)
    names = sorted(name.decode() for name in redis_client.scan_iter(f"{prefix}*"))
    assert f"{prefix}django:/1/answer" in names
    hashed = [name for name in names if name.startswith(f"{prefix}django:=")]
    assert len(hashed) == 1 and len(hashed[0]) == len(f"{prefix}django:=") + 64
    assert (cache.get("answer"), cache.get("key with spaces")) == (42, 1)


def test_a_set_in_one_process_drops_the_l1_copy_in_another(redis_url: str, prefix: str) -> None:
    writer, reader = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    writer.set("price", "12.90")
    assert reader.get("price") == "12.90"  # now in the reader's L1 for up to 5 s
    writer.set("price", "9.90")
    deadline = time.monotonic() + 3
    while reader.get("price") != "9.90":
        assert time.monotonic() < deadline, "the reader kept its L1 copy"
        time.sleep(0.02)
    writer.delete("price")
    deadline = time.monotonic() + 3
    while reader.get("price") is not None:
        assert time.monotonic() < deadline, "the reader kept a deleted value"
        time.sleep(0.02)


def test_get_or_set_calls_the_default_once_for_concurrent_misses_in_two_processes(
    redis_url: str, prefix: str
) -> None:
    caches = [backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)]
    calls: list[int] = []
    barrier = threading.Barrier(20)

    def expensive() -> dict[str, int]:
        calls.append(1)
        time.sleep(0.3)
        return {"books": 42}

    def read(index: int) -> Any:
        barrier.wait(5)
        return caches[index % 2].get_or_set("report", expensive, timeout=60)

    threads_results: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: threads_results.append(read(i))) for i in range(20)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert threads_results == [{"books": 42}] * 20
    assert len(calls) == 1


def test_get_or_set_never_calls_the_default_again_while_its_value_is_present(
    redis_url: str, prefix: str
) -> None:
    """An entry's Django timeout is its soft expiry, and XFetch refreshed it early: a
    get_or_set shortly before the timeout returned the value and ran ``default`` again in
    the background. Django never calls ``default`` while a value is present."""
    calls: list[int] = []

    def report() -> str:
        calls.append(1)
        time.sleep(0.3)  # the measured load time: XFetch refreshes within a few of them
        return "report"

    eager = {"django": {"key": "django:{key}", "stampede": {"early_refresh_beta": 100}}}
    writer = backend(redis_url, prefix, config={"namespaces": eager})
    reader = backend(redis_url, prefix, config={"namespaces": eager}, timeout=19.0)
    assert writer.get_or_set("report", report, timeout=2) == "report"
    time.sleep(1.5)  # 0.5 s before the timeout: beta 100 refreshes at once
    assert reader.get_or_set("report", report, timeout=2) == "report"
    time.sleep(0.4)  # a background refresh, had one started, has called report()
    assert len(calls) == 1
    assert reader.layered.stats()["django"]["early_refresh"] == 0


def test_timeouts_are_exact_in_every_layer_and_redis_forgets_the_entry_with_them(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    cache = backend(redis_url, prefix)
    cache.set("short", "v", timeout=1)
    assert 0 < redis_client.pttl(f"{prefix}django:/1/short") <= 1000
    cache.set("forever", "v", timeout=None)
    assert redis_client.pttl(f"{prefix}django:/1/forever") > 365 * 86400 * 1000
    assert cache.get("short") == "v"  # in L1, whose TTL is 5 s
    time.sleep(1.1)
    assert cache.get("short") is None and not cache.has_key("short")
    assert redis_client.exists(f"{prefix}django:/1/short") == 0
    assert cache.get("forever") == "v"


def test_incr_keeps_the_remaining_timeout(redis_url: str, prefix: str) -> None:
    cache = backend(redis_url, prefix)
    cache.set("hits", 1, timeout=1)
    assert cache.incr("hits", 5) == 6
    time.sleep(1.1)
    assert cache.get("hits") is None


def test_a_set_without_timeout_outlives_a_racing_set_with_one(
    redis_url: str, prefix: str
) -> None:
    """Two processes set one key at once, one with timeout=2, one without. The PEXPIRE
    that followed each write could land on the other's value: the value without timeout
    vanished after 2 s (12 of 17 such rounds, before the TTL rode in the write)."""
    a, b = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    reader = backend(redis_url, prefix, timeout=18.0)
    last_without: list[str] = []
    for i in range(20):
        key, barrier = f"r{i}", threading.Barrier(2)

        def with_timeout(k: str = key, bar: threading.Barrier = barrier) -> None:
            bar.wait(5)
            a.set(k, "A", timeout=2)

        def without(k: str = key, bar: threading.Barrier = barrier) -> None:
            bar.wait(5)
            b.set(k, "B", timeout=None)

        writers = [threading.Thread(target=with_timeout), threading.Thread(target=without)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(10)
        if reader.get(key) == "B":
            last_without.append(key)
    time.sleep(2.5)
    fresh = backend(redis_url, prefix, timeout=17.0)
    assert [key for key in last_without if fresh.get(key) is None] == []


def test_ints_beyond_64_bits_are_stored_and_counted_past(redis_url: str, prefix: str) -> None:
    """docs/django.md: Python ints, no 64-bit limit (msgpack's stop there: it raised
    OverflowError, which is not the PickleError the docs promise for what can't be kept)."""
    cache, other = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    cache.set("big", 2**100)
    cache.set("n", 2**64 - 1)
    assert cache.incr("n") == 2**64
    cache.set("m", -(2**63))
    assert cache.decr("m") == -(2**63) - 1
    assert (other.get("big"), other.get("n"), other.get("m")) == (2**100, 2**64, -(2**63) - 1)


def test_values_come_back_as_the_type_they_went_in_as(redis_url: str, prefix: str) -> None:
    cache, other = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    value = {
        "tuple": (1, (2, "x")),
        "set": {1, 2},
        "frozenset": frozenset({"a"}),
        "decimal": decimal.Decimal("12.90"),
        "uuid": uuid.UUID(int=42),
        "naive": datetime.datetime(2026, 11, 29, 10, 0),
        "aware": datetime.datetime(2026, 11, 29, 10, 0, tzinfo=datetime.UTC),
        "date": datetime.date(2026, 11, 29),
        "delta": datetime.timedelta(days=1, seconds=2),
        "bytes": b"\x00\xff",
        (1, "tuple-key"): None,
        "fragment": mark_safe("<b>Dune</b>"),
    }
    cache.set("value", value)
    for reader in (cache, other):  # from L1 and from L2
        got = reader.get("value")
        assert got == value
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in value.items()}
        assert isinstance(got["fragment"], SafeString)


def test_an_aware_datetime_comes_back_in_its_zone_not_a_fixed_offset(
    redis_url: str, prefix: str
) -> None:
    """Its ISO string alone brought a ZoneInfo datetime back with a fixed offset: a day
    later across a DST change was then an hour off."""
    paris = zoneinfo.ZoneInfo("Europe/Paris")
    value = {
        "before_dst_ends": datetime.datetime(2026, 10, 24, 12, 0, tzinfo=paris),
        "second_0230": datetime.datetime(2026, 10, 25, 2, 30, tzinfo=paris, fold=1),
        "utc": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        "offset": datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=5))),
        "time": datetime.time(10, 0, tzinfo=datetime.UTC),
    }
    cache, other = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    cache.set("when", value)
    day = datetime.timedelta(days=1)
    for reader in (cache, other):  # from L1 and from L2
        got = reader.get("when")
        assert got == value
        assert got["before_dst_ends"].tzinfo is paris
        assert got["before_dst_ends"] + day == value["before_dst_ends"] + day
        assert got["second_0230"].fold == 1
        assert got["second_0230"].utcoffset() == datetime.timedelta(hours=1)
        assert got["utc"].tzinfo is datetime.UTC


@pytest.mark.parametrize(
    "value",
    [
        datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=1), "CET")),
        datetime.time(10, 0, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")),
    ],
)
def test_a_time_whose_zone_would_come_back_otherwise_is_refused(
    redis_url: str, prefix: str, value: Any
) -> None:
    cache = backend(redis_url, prefix)
    with pytest.raises(UncacheableValue, match="fixed offset"):
        cache.set("when", value)
    assert cache.get("when") is None


def _plant_unreadable_payload(client: redis.Redis, prefix: str, key: str) -> None:
    """Replace the payload inside the stored entry with one this backend can't read
    (an extension type it doesn't know), leaving the envelope itself valid."""
    name = f"{prefix}django:/1/{key}"  # Django's key function, ``_django_keys``
    envelope = msgspec.msgpack.decode(client.get(name))
    envelope[1][0] = msgspec.msgpack.encode(msgspec.msgpack.Ext(99, b"planted"))
    client.set(name, msgspec.msgpack.encode(envelope))


def test_an_unreadable_payload_in_redis_is_a_miss_that_the_next_set_repairs(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    """Every read of such a key raised msgspec.DecodeError: a 500 on each request until
    the key expired, and get_or_set could not repair it either."""
    writer = backend(redis_url, prefix)
    for key in ("a", "b", "c", "n"):
        writer.set(key, 1)
        _plant_unreadable_payload(redis_client, prefix, key)
    reader = backend(redis_url, prefix, timeout=19.0)  # no L1 copy: reads Redis
    assert reader.get("a", "default") == "default"
    assert reader.get_many(["a", "b"]) == {}
    assert reader.get_or_set("c", "fresh") == "fresh"
    assert reader.get("c") == "fresh"
    with pytest.raises(ValueError, match="can't be read"):
        reader.incr("n")
    reader.set("a", "repaired")
    assert reader.get("a") == "repaired"
    stats = reader._parts()[0].stats()["django"]
    assert stats["decode_error"] >= 4


def test_a_cached_response_comes_back_with_status_headers_cookies_and_content(
    redis_url: str, prefix: str
) -> None:
    cache = backend(redis_url, prefix)
    response = HttpResponse("<h1>Dune</h1>", status=203, headers={"X-Shelf": "sf"})
    response.set_cookie("seen", "1", max_age=60)
    cache.set("page", response)
    got = backend(redis_url, prefix, timeout=19.0).get("page")
    assert (got.status_code, got.content, got["X-Shelf"]) == (203, b"<h1>Dune</h1>", "sf")
    assert got.cookies["seen"].value == "1" and got.cookies["seen"]["max-age"] == 60


def test_an_uncacheable_value_is_a_pickle_error_and_writes_nothing(
    redis_url: str, prefix: str
) -> None:
    cache = backend(redis_url, prefix)
    cache.set("a", "kept")

    class Book:
        pass

    with pytest.raises(UncacheableValue, match="never pickles") as raised:
        cache.set_many({"a": "replaced", "b": Book()})
    assert isinstance(raised.value, pickle.PickleError) and isinstance(raised.value, TypeError)
    assert cache.get_many(["a", "b"]) == {"a": "kept"}


def test_clear_removes_the_django_namespace_only(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    config = {"namespaces": {"book": {"key": "book:{id}"}}}
    cache = backend(redis_url, prefix, config=config)
    other = backend(redis_url, prefix, config=config, timeout=19.0)
    cache.layered.set("book", {"id": 42}, "Dune")
    cache.set_many({f"k{i}": i for i in range(250)})
    assert other.get("k7") == 7  # in the other process's L1
    cache.clear()
    assert redis_client.exists(f"{prefix}book:42") == 1
    assert list(redis_client.scan_iter(f"{prefix}django:*")) == []
    deadline = time.monotonic() + 3
    while other.get("k7") is not None:
        assert time.monotonic() < deadline, "clear() did not reach the other L1"
        time.sleep(0.02)


def test_clear_skips_a_foreign_name_too_long_to_be_a_key_and_clears_the_rest(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    """A name under ``django:`` no key can be (another app's, an operator's, 600
    characters) made clear() raise ``key is 607 characters``: the keys after it stayed,
    and every later clear() failed on the same name."""
    cache = backend(redis_url, prefix)
    cache.set_many({f"k{i}": i for i in range(250)})
    foreign = f"{prefix}django:" + "a" * 600
    redis_client.set(foreign, b"not ours")
    cache.clear()
    cache.set("again", 1)
    cache.clear()
    assert [name.decode() for name in redis_client.scan_iter(f"{prefix}django:*")] == [foreign]
    assert cache.get("k7") is None


def test_clear_empties_a_namespace_too_large_to_clear_within_one_calls_timeout(
    redis_url: str, prefix: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clear() was one sync call bounded by OPTIONS["timeout"] as a whole: at a few
    thousand keys a second, a namespace of 100k keys (20 s, the default) could not be
    cleared, and the call failed half done. Scaled down: 10,000 keys, each step of 100
    made 30 ms slower (3 s in all: on any machine more than the 1 s timeout, and each
    step well within it, even on a loaded CI machine)."""
    import layered_cache._django_clear as django_clear

    filler = backend(redis_url, prefix)  # default timeout: filling is not under test
    for start in range(0, 10_000, 500):
        assert filler.set_many({f"page{i}": i for i in range(start, start + 500)}) == []
    assert filler.get("page0") == 0  # in the filler's L1
    invalidate_all = django_clear.invalidate_all

    async def slower(cache: Any, namespace: str, batch: list[Any]) -> None:
        await asyncio.sleep(0.03)
        await invalidate_all(cache, namespace, batch)

    monkeypatch.setattr(django_clear, "invalidate_all", slower)
    cache = backend(redis_url, prefix, timeout=1.0)
    cache.clear()
    assert list(redis_client.scan_iter(f"{prefix}django:*", count=1000)) == []
    deadline = time.monotonic() + 3
    while filler.get_many(["page0", "page9999"]) != {}:
        assert time.monotonic() < deadline, "clear() did not reach the other L1"
        time.sleep(0.02)


def test_a_clear_step_that_times_out_says_which_and_the_next_clear_finishes(
    redis_server: RedisServer, prefix: str
) -> None:
    """A clear() cut by the timeout blamed "the loader"; it says which step timed out
    and that the keys not reached remain. (A server of its own: its writes are paused.)"""
    admin = redis_server.client()
    cache = backend(redis_server.url, prefix, timeout=0.5)
    cache.set_many({f"k{i}": i for i in range(250)})
    admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # invalidations hang
    with pytest.raises(SyncTimeoutError, match=r"invalidating 100 keys .* clear\(\) again"):
        cache.clear()
    time.sleep(1.5)
    deadline = time.monotonic() + 10
    while True:  # the paused writes may have opened the breaker: it closes by itself
        try:
            cache.clear()
            break
        except L2Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert list(admin.scan_iter(f"{prefix}django:*")) == []
    admin.close()


def test_clear_with_redis_down_raises_l2unavailable_like_every_other_write(prefix: str) -> None:
    """clear() scanned with the raw client: redis-py's ConnectionError got out, past
    the breaker, where every other write raises L2Unavailable."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = int(sock.getsockname()[1])
    config = {"redis": {"timeout": "200ms", "connect_timeout": "200ms"}}
    cache = backend(f"redis://127.0.0.1:{closed_port}/0", prefix, config=config)
    assert cache.get("k") is None  # a read is a miss
    with pytest.raises(L2Unavailable):
        cache.set("k", 1)
    with pytest.raises(L2Unavailable):
        cache.clear()
    with pytest.raises(L2Unavailable):
        cache.delete("k")
    with pytest.raises(L2Unavailable):
        cache.clear()  # the breaker open by now: refused at once


def test_config_from_a_toml_file_with_inline_options_merged_over_it(
    redis_url: str, prefix: str, tmp_path: Path, redis_client: redis.Redis
) -> None:
    path = tmp_path / "layered_cache.toml"
    path.write_text(
        f'[redis]\nurl = "{redis_url}"\nprefix = "file:"\n\n'
        '[namespaces.pages]\nkey = "pages:{key}"\nl1 = { ttl = "1s" }\n'
    )
    cache = LayeredCacheBackend(
        str(path), {"OPTIONS": {"config": {"redis": {"prefix": prefix}}, "namespace": "pages"}}
    )
    cache.set("home", "<html>")
    assert redis_client.exists(f"{prefix}pages:/1/home") == 1
    assert cache.layered.cache.namespace("pages").policy.l1_ttl == 1.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"colour": "blue"}, r"unknown \['colour'\]"),
        (
            {"config": {"namespaces": {"django": {"key": "dj:{a}:{b}"}}}},
            "exactly one placeholder",
        ),
        ({"config": {"redis": {"timeout": "soon"}}}, "redis.timeout"),
    ],
)
def test_a_bad_caches_entry_is_a_config_error_saying_what_is_wrong(
    redis_url: str, prefix: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        backend(redis_url, prefix, **options).get("x")


@pytest.mark.filterwarnings("ignore::django.core.cache.CacheKeyWarning")
def test_key_functions_may_return_anything_and_keys_stay_distinct(
    redis_url: str, prefix: str
) -> None:
    cache = backend(redis_url, prefix)
    cache.key_func = lambda key, key_prefix, version: key  # e.g. a KEY_FUNCTION
    for key in ["a/b", "a:b", "a=b", "=" + "0" * 64, "清", "a" * 300]:
        cache.set(key, key)
    for key in ["a/b", "a:b", "a=b", "=" + "0" * 64, "清", "a" * 300]:
        assert cache.get(key) == key


def _child_round_trip(cache: LayeredCacheBackend, results: Any) -> None:
    results.put((cache.get("parent"), cache.get_or_set("child", lambda: "from-child")))


def test_a_backend_used_before_a_fork_works_in_the_child(redis_url: str, prefix: str) -> None:
    cache = backend(redis_url, prefix)
    cache.set("parent", "from-parent")
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child_round_trip, args=(cache, results))
    child.start()
    child.join(15)
    assert child.exitcode == 0
    assert results.get(timeout=1) == ("from-parent", "from-child")
    assert cache.get("child") == "from-child"


class _SlowTerminal:
    """A stdout whose write blocks in the parent until released (a slow pipe, a full
    terminal buffer, a lagging log shipper): the writer holds structlog's write lock."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        if os.getpid() == self.parent:
            self.entered.set()
            self.release.wait(30)
        return len(text)

    def flush(self) -> None:
        pass


def _answer_of_forked_child(cache: LayeredCacheBackend, key: str) -> str:
    """``repr(cache.get(key))`` in a forked child (or the error it raised), waited 20 s."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            answer = repr(cache.get(key))
        except BaseException as exc:  # report whatever it is, don't hang the parent
            answer = f"{type(exc).__name__}: {exc}"[:300]
        os.write(write_end, answer.encode())
        os._exit(0)
    os.close(write_end)
    return _read_then_reap(read_end, pid)


def _read_then_reap(read_end: int, pid: int) -> str:
    ready, _, _ = select.select([read_end], [], [], 20)
    answer = os.read(read_end, 4096).decode() if ready else "no answer within 20 s"
    os.close(read_end)
    deadline = time.monotonic() + 15
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    return answer


def test_a_worker_forked_while_the_loop_thread_writes_a_log_line_can_use_the_cache(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/django.md: "Pre-forking servers are fine: a backend used in the gunicorn
    master (``--preload``) rebuilds its loop and connections in each worker on first
    use"; README, *Fork-safe*: a fork "while another thread of the parent holds one
    [lock] ... leaves the child able to load".

    Scenario: the backend used in the parent; its loop thread logs ``value_too_large``
    through structlog's default logger (an app that did not configure logging) to a
    stdout whose write is slow at that moment; the parent forks a worker then. The
    worker's every call failed ("starting the cache did not finish within 3.0 s"): its
    new loop thread blocked at its first log line on structlog's per-file write lock
    (``structlog._output.WRITE_LOCKS``), copied held. Now the at-fork hook of
    ``_forklock`` releases it in the child."""
    reset_logging()  # structlog's defaults, as in an app that did not configure logging
    config = {"namespaces": {"django": {"key": "django:{key}", "max_value_bytes": 2000}}}
    cache = backend(redis_url, prefix, config=config, timeout=3.0)
    cache.set("parent", "from-parent")
    terminal = _SlowTerminal(os.getpid())
    monkeypatch.setattr(sys, "stdout", terminal)
    writer = threading.Thread(target=cache.set, args=("big", "x" * 5000), daemon=True)
    writer.start()  # the loop thread logs value_too_large and blocks in the write
    assert terminal.entered.wait(5)
    try:
        answer = _answer_of_forked_child(cache, "parent")
    finally:
        terminal.release.set()
        writer.join(10)
        monkeypatch.undo()
    assert answer == repr("from-parent")


def test_close_after_each_request_leaves_the_shared_cache_working(
    redis_url: str, prefix: str
) -> None:
    cache = backend(redis_url, prefix)
    cache.set("k", 1)
    cache.close()  # Django's request_finished handler
    assert cache.get("k") == 1


def test_an_invalidation_by_key_fields_reaches_every_process(redis_url: str, prefix: str) -> None:
    # What the daemon does for {"type": "CacheInvalidate", "namespace": "django",
    # "keys": [{"key": "/1/price"}]}: the same name, the same delete-then-backplane.
    cache, other = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    cache.set("price", "12.90")
    assert other.get("price") == "12.90"
    assert cache.key_fields("price") == {"key": "/1/price"}
    cache.layered.invalidate("django", cache.key_fields("price"))
    deadline = time.monotonic() + 3
    while other.get("price") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_async_django_calls_work_and_aget_or_set_calls_the_default_once(
    redis_url: str, prefix: str
) -> None:
    cache = backend(redis_url, prefix)
    calls: list[int] = []

    def expensive() -> int:
        calls.append(1)
        time.sleep(0.2)
        return 2

    async def views() -> Any:  # async views: Django runs the sync backend in a thread
        await cache.aset("k", {"v": 1})
        values = await asyncio.gather(*(cache.aget_or_set("g", expensive) for _ in range(10)))
        return await cache.aget("k"), values

    assert asyncio.run(views()) == ({"v": 1}, [2] * 10)
    assert len(calls) == 1


def test_a_value_too_large_to_cache_deletes_the_one_it_replaces(
    redis_url: str, prefix: str
) -> None:
    # As memcached does: a failed set must not leave the previous value to be served.
    config = {"namespaces": {"django": {"key": "django:{key}", "max_value_bytes": 2000}}}
    cache = backend(redis_url, prefix, config=config)
    cache.set("page", "small")
    cache.set("page", "x" * 1990)  # fits as a payload, not with its envelope
    assert cache.get("page") is None
    assert cache.layered.stats()["django"]["not_cached"] == 1
    cache.set("page", "x" * 1500)
    assert cache.get("page") == "x" * 1500
    # set_many names the keys it could not insert, as Django documents (it said none).
    assert cache.set_many({"a": "small", "b": "x" * 1990, "c": "ok"}) == ["b"]
    assert cache.get_many(["a", "b", "c"]) == {"a": "small", "c": "ok"}


def test_hot_key_replicas_expire_with_the_entry(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    config = {
        "namespaces": {
            "django": {"key": "django:{key}", "hot": {"replicas": 2, "keys": ["django:/1/home"]}}
        }
    }
    cache = backend(redis_url, prefix, config=config)
    cache.set("home", "<html>", timeout=30)
    for name in ("django:/1/home", "django:/1/home#0", "django:/1/home#1"):
        assert 0 < redis_client.pttl(f"{prefix}{name}") <= 30_000


def test_on_a_redis_cluster_clear_reaches_every_master(redis_cluster: Any, prefix: str) -> None:
    config = {"redis": {"cluster": True, "timeout": "1s"}}
    cache = backend(redis_cluster.url, prefix, config=config)
    cache.set_many({f"k{i}": i for i in range(60)})  # spread over the three masters
    assert cache.get_many(["k1", "k59"]) == {"k1": 1, "k59": 59}
    holding = 0
    for host, port in redis_cluster.nodes:
        with redis.Redis(host=host, port=port) as node:
            holding += any(node.scan_iter(f"{prefix}django:*"))
    assert holding == 3
    cache.clear()
    other = backend(redis_cluster.url, prefix, config={**config}, timeout=19.0)
    assert other.get_many([f"k{i}" for i in range(60)]) == {}


def _race(caches: list[LayeredCacheBackend], threads: int, call: Any) -> list[Any]:
    """``call(cache)`` from ``threads`` threads at once, alternating between ``caches``."""
    barrier = threading.Barrier(threads)
    results: list[Any] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        barrier.wait(5)
        result = call(caches[index % len(caches)])
        with lock:
            results.append(result)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    return results


def test_add_admits_exactly_one_of_many_concurrent_adders_across_processes(
    redis_url: str, prefix: str
) -> None:
    caches = [backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)]
    for round_ in range(3):
        results = _race(caches, 20, lambda cache: cache.add(f"lock{round_}", "mine", 30))
        assert sorted(results) == [False] * 19 + [True]


def test_incr_loses_no_increment_across_processes(redis_url: str, prefix: str) -> None:
    caches = [backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)]
    caches[0].set("hits", 0)
    results = _race(caches, 20, lambda cache: [cache.incr("hits") for _ in range(5)])
    # Every increment returned a distinct count: none was lost or applied twice.
    assert sorted(n for counts in results for n in counts) == list(range(1, 101))
    deadline = time.monotonic() + 3
    # Each process's L1 follows within the backplane's bound: the one whose own last
    # increment was not the last one (a CI run read 99 at once) learns of the other's.
    while [cache.get("hits") for cache in caches] != [100, 100]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_clear_drops_this_processs_copies_of_keys_redis_no_longer_holds(
    redis_url: str, prefix: str
) -> None:
    """clear() invalidated only the names its SCAN found: a key evicted from Redis
    stayed in L1 and was served after it, even in the process that called clear()."""
    cache = backend(redis_url, prefix)
    cache.set("k", "v")
    assert cache.get("k") == "v"  # in L1
    admin = redis.Redis.from_url(redis_url)
    try:
        assert admin.delete(f"{prefix}django:/1/k") == 1  # what maxmemory eviction does
    finally:
        admin.close()
    cache.clear()
    assert cache.get("k") is None
