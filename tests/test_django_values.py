"""The Django backend's values, tried the hard way (an adversarial review, 2026-12-04):
payloads planted in Redis that the decoders choke on must read as a miss from every
call, and values must come back as they went in or be refused with
``UncacheableValue`` before anything is written, never changed on the way."""

from __future__ import annotations

import datetime
import functools
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from msgspec.msgpack import Ext, encode

from tests import djangoconf

djangoconf.configure()

from django.http import HttpResponseNotModified  # noqa: E402

from layered_cache.django import UncacheableValue  # noqa: E402
from tests.test_django_backend import _close_shared, backend  # noqa: E402, F401


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _plant(client: redis.Redis, prefix: str, key: str, payload: bytes) -> None:
    """Replace the payload inside the stored entry, the envelope left valid."""
    name = f"{prefix}django:/1/{key}"
    envelope = msgspec.msgpack.decode(client.get(name))
    envelope[1][0] = payload
    client.set(name, msgspec.msgpack.encode(envelope))


def _response(*fields: Any) -> bytes:  # ext 11: [status, reason, charset, headers, body, cookies]
    return encode(Ext(11, encode(list(fields))))


PLANTED = {
    "unknown extension": encode(Ext(99, b"x")),
    "arrays 1,000 deep": b"\x91" * 1000 + b"\xc0",
    "tuples 400 deep": functools.reduce(
        lambda inner, _: encode(Ext(1, b"\x91" + inner)), range(400), encode(None)
    ),
    "cookie name with a space": _response(200, "OK", "utf-8", [], b"", [["a b", "v", {}]]),
    "reserved cookie name": _response(200, "OK", "utf-8", [], b"", [["expires", "v", {}]]),
    "unknown cookie attribute": _response(200, "OK", "utf-8", [], b"", [["a", "v", {"x": 1}]]),
    "cookie name that is an int": _response(200, "OK", "utf-8", [], b"", [[5, "v", {}]]),
    "unknown charset": _response(200, "OK", "no-such-codec", [], "x", []),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
@pytest.mark.parametrize("call", ["get", "get_many", "get_or_set", "incr", "has_key", "add"])
def test_a_planted_payload_is_a_miss_for_every_call(
    redis_url: str, prefix: str, admin: redis.Redis, kind: str, call: str
) -> None:
    """Each of these made get/get_many/get_or_set raise on every read of the key until
    it expired (RecursionError, CookieError, AttributeError, LookupError); has_key said
    present and add refused while get said missing."""
    backend(redis_url, prefix).set("k", 1)
    _plant(admin, prefix, "k", PLANTED[kind])
    reader = backend(redis_url, prefix, timeout=19.0)  # no L1 copy: reads Redis
    if call == "get":
        assert reader.get("k", "default") == "default"
    elif call == "get_many":
        assert reader.get_many(["k"]) == {}
    elif call == "get_or_set":
        assert reader.get_or_set("k", "fresh") == "fresh"
    elif call == "incr":
        with pytest.raises(ValueError, match="can't be read"):
            reader.incr("k")
    elif call == "has_key":
        assert reader.has_key("k") is False
    else:
        assert reader.add("k", 2) is True
        assert reader.get("k") == 2


@pytest.mark.parametrize(
    "value",
    [
        "\ud800",  # a lone surrogate: UnicodeEncodeError
        10**5000,  # more digits than str() writes: ValueError
        (lambda items: (items.append(items), items)[1])([]),  # contains itself: RecursionError
        functools.reduce(lambda inner, _: {(1,): inner}, range(240), None),  # 240 deep
        datetime.datetime(2021, 1, 1, tzinfo=datetime.timezone(datetime.timedelta(microseconds=1))),
        datetime.time(1, tzinfo=datetime.timezone(datetime.timedelta(microseconds=500_000))),
    ],
    ids=["surrogate", "5000 digits", "contains itself", "240 deep", "1us offset", "0.5s offset"],
)
def test_what_cant_come_back_as_it_went_in_is_refused_as_uncacheable(
    redis_url: str, prefix: str, value: Any
) -> None:
    """They raised UnicodeEncodeError, ValueError or RecursionError (not the
    PickleError code written for pickling backends catches); a sub-second offset came
    back as UTC; 240 levels were written and then failed every read."""
    cache = backend(redis_url, prefix)
    cache.set("k", "kept")
    with pytest.raises(UncacheableValue):
        cache.set("k", value)
    assert cache.get("k") == "kept"


@pytest.mark.parametrize(
    "value",
    [
        {2**70: "x", -(2**70): "y"},  # big ints as dict keys (OverflowError before)
        functools.reduce(lambda inner, _: {(1,): inner}, range(99), None),  # deep, under the cap
        datetime.datetime(2021, 11, 7, 1, 30, fold=1),  # naive, the second 01:30
        datetime.time(1, 30, fold=1),
        datetime.datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=datetime.UTC),
        datetime.datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("America/New_York")),
    ],
    ids=["bigint keys", "99 deep", "naive fold", "time fold", "utc fold", "zoned fold"],
)
def test_a_value_comes_back_exactly_from_l1_and_l2(redis_url: str, prefix: str, value: Any) -> None:
    """fold=1 came back as 0 (a naive datetime's timestamp() then moved by an hour)."""
    cache, other = backend(redis_url, prefix), backend(redis_url, prefix, timeout=19.0)
    cache.set("k", value)
    for got in (cache.get("k"), other.get("k")):
        assert got == value
        if isinstance(value, datetime.datetime | datetime.time):
            assert (got.fold, got.utcoffset(), got.tzinfo) == (
                value.fold,
                value.utcoffset(),
                value.tzinfo,
            )


def test_a_zone_read_from_a_file_under_another_zones_key_is_refused(
    redis_url: str, prefix: str
) -> None:
    """Tokyo's data under the key Europe/Paris came back as Paris."""
    path = next(p for p in map(Path, zoneinfo.TZPATH) if (p / "Asia/Tokyo").exists())
    with open(path / "Asia/Tokyo", "rb") as data:
        impostor = zoneinfo.ZoneInfo.from_file(data, key="Europe/Paris")
    with pytest.raises(UncacheableValue):
        backend(redis_url, prefix).set("k", datetime.datetime(2026, 1, 1, tzinfo=impostor))


def test_a_cached_304_comes_back_with_no_header_it_did_not_have(
    redis_url: str, prefix: str
) -> None:
    """HttpResponse adds a Content-Type; a 304 (which the cache middleware caches) has
    none, and came back with one."""
    response = HttpResponseNotModified()
    backend(redis_url, prefix).set("page", response)
    got = backend(redis_url, prefix, timeout=19.0).get("page")
    assert (got.status_code, dict(got.headers)) == (304, dict(response.headers))
