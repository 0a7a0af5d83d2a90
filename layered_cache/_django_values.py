"""Django cache values as bytes, without pickle: what ``layered_cache.django`` stores.

Django's own backends pickle, so reading a cache can run code; layered_cache never
unpickles (a poisoned Redis must not be able to run code). Values are msgpack
(msgspec), with an extension type for each Python type msgpack would flatten, so a
value comes back as the type it went in as: ``tuple`` stays a tuple, ``Decimal`` a
Decimal, a naive ``datetime`` naive. Exact types only: a subclass (an ``IntEnum``, an
``OrderedDict``, a model instance) would come back as something else, so it is refused
with ``UncacheableValue`` rather than silently changed. An aware ``datetime`` keeps its
zone: a ``zoneinfo.ZoneInfo`` by its key (an ISO offset alone would bring back a fixed
offset, and arithmetic across a DST change would drift by an hour), a fixed
``datetime.timezone`` by its offset; other ``tzinfo`` classes (pytz, dateutil) are
refused. Two Django types are carried
because Django caches them itself: ``SafeString`` (template fragments) and
``HttpResponse`` (``cache_page``; any non-streaming response comes back as an
``HttpResponse`` with the same status, headers, cookies and content).
"""

from __future__ import annotations

import datetime
import decimal
import pickle
import uuid
import zoneinfo
from collections.abc import Callable
from typing import Any

import msgspec
from django.http import HttpResponse
from django.utils.safestring import SafeString

__all__ = ["Entry", "UncacheableValue", "UndecodableValue", "dumps", "loads", "readable"]


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One Django cache entry as the namespace stores it (L1 and L2)."""

    payload: bytes  # the value, encoded by ``dumps``
    expires_at: float | None  # Redis' time after which it is gone; None: no own expiry


class UncacheableValue(TypeError, pickle.PickleError):
    """A value this backend can't store faithfully. Also a ``pickle.PickleError``: code
    written for Django's pickling backends catches that around ``cache.set``."""


class UndecodableValue(ValueError):
    """A payload this backend can't read back: planted in Redis, cut, or written by a
    version with more types. The backend reads it as a miss (``django._value``)."""


_encoder = msgspec.msgpack.Encoder()
_PLAIN = (str, int, float, bool, bytes, type(None))
_TUPLE, _SET, _FROZENSET, _DECIMAL, _UUID, _DATETIME = 1, 2, 3, 4, 5, 6
_DATE, _TIME, _TIMEDELTA, _SAFESTRING, _RESPONSE, _BYTEARRAY = 7, 8, 9, 10, 11, 12
_PAIRS = 13  # a dict with a key msgpack can't hold as a map key (a tuple, a Decimal, ...)
_BIGINT = 14  # an int beyond msgpack's 64 bits, as its decimal digits
_ZONED = 15  # a datetime in a ZoneInfo zone: [naive ISO, the zone's key, fold]
_DATETIME_FOLD, _TIME_FOLD = 16, 17  # as _DATETIME and _TIME, with fold=1 (the 2nd 01:30)
# Containers within containers: reading one back takes Python frames per level (the
# extension hook), so a value much deeper would be written and then fail every read.
_MAX_DEPTH = 100
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _response(response: HttpResponse) -> bytes:
    cookies = [
        (name, morsel.value, dict(morsel.items())) for name, morsel in response.cookies.items()
    ]
    return _encoder.encode(
        [
            response.status_code,
            response.reason_phrase,
            response.charset,
            list(response.headers.items()),
            response.content,
            cookies,
        ]
    )


def _fixed(zone: datetime.tzinfo | None) -> bool:
    """No zone, or a ``datetime.timezone`` that its ISO offset rebuilds as it was (the
    offset alone: a name of its own, ``timezone(offset, "CET")``, would be lost)."""
    if zone is None:
        return True
    if type(zone) is not datetime.timezone:
        return False
    offset = zone.utcoffset(None)
    if offset.microseconds:  # Python 3.11 reads "+00:00:00.000001" back as UTC
        return False
    return zone.tzname(None) == datetime.timezone(offset).tzname(None)


def _keyed(zone: datetime.tzinfo | None) -> bool:
    """A ``ZoneInfo`` that its key gives back: not one read from a file under a key
    that names another zone (``ZoneInfo.from_file(f, key=...)``)."""
    if type(zone) is not zoneinfo.ZoneInfo or zone.key is None:
        return False
    try:
        return zoneinfo.ZoneInfo(zone.key) is zone
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        return False


def _zone_refused(zone: datetime.tzinfo) -> UncacheableValue:
    kind = type(zone)
    return UncacheableValue(
        f"can't cache a time in a {kind.__module__}.{kind.__qualname__} zone: it would come "
        "back as a fixed offset; use zoneinfo.ZoneInfo or datetime.timezone "
        "(docs/django.md#values)"
    )


def _datetime(value: datetime.datetime) -> msgspec.msgpack.Ext:
    zone = value.tzinfo
    if _fixed(zone):
        code = _DATETIME_FOLD if value.fold else _DATETIME
        return msgspec.msgpack.Ext(code, value.isoformat().encode())
    if isinstance(zone, zoneinfo.ZoneInfo) and _keyed(zone):
        naive = value.replace(tzinfo=None).isoformat()
        return msgspec.msgpack.Ext(_ZONED, _encoder.encode([naive, zone.key, value.fold]))
    assert zone is not None
    raise _zone_refused(zone)


def _time(value: datetime.time) -> msgspec.msgpack.Ext:
    if not _fixed(value.tzinfo):  # a ZoneInfo time has no offset: it would come back naive
        assert value.tzinfo is not None
        raise _zone_refused(value.tzinfo)
    return msgspec.msgpack.Ext(_TIME_FOLD if value.fold else _TIME, value.isoformat().encode())


def _zoned(data: memoryview) -> datetime.datetime:
    naive, key, fold = _decoder.decode(data)
    moment = datetime.datetime.fromisoformat(naive)
    return moment.replace(tzinfo=zoneinfo.ZoneInfo(key), fold=fold)


_CONTAINERS: dict[type, int] = {tuple: _TUPLE, set: _SET, frozenset: _FROZENSET}
_TO_EXT: dict[type, tuple[int, Callable[[Any], bytes]]] = {
    decimal.Decimal: (_DECIMAL, lambda v: str(v).encode()),
    uuid.UUID: (_UUID, lambda v: v.bytes),
    datetime.date: (_DATE, lambda v: v.isoformat().encode()),
    datetime.timedelta: (
        _TIMEDELTA,
        lambda v: _encoder.encode([v.days, v.seconds, v.microseconds]),
    ),
    SafeString: (_SAFESTRING, lambda v: str.encode(v)),
    bytearray: (_BYTEARRAY, bytes),
}


def _plain(value: Any) -> bool:
    """msgpack holds it as it is (a map key too): not an int beyond 64 bits."""
    kind = type(value)
    return kind in _PLAIN and (kind is not int or _INT_MIN <= value <= _INT_MAX)


def _wire(value: Any, depth: int = 0) -> Any:
    """``value`` as msgspec encodes it: plain types as they are, others as Ext."""
    kind = type(value)
    if kind in _PLAIN:
        if kind is int and not _INT_MIN <= value <= _INT_MAX:
            return msgspec.msgpack.Ext(_BIGINT, str(value).encode())
        return value
    if depth >= _MAX_DEPTH:
        raise UncacheableValue(
            f"can't cache a value nested more than {_MAX_DEPTH} containers deep "
            "(or one that contains itself)"
        )
    if kind is list:
        return [_wire(item, depth + 1) for item in value]
    if kind is dict:
        if all(_plain(key) for key in value):
            return {key: _wire(item, depth + 1) for key, item in value.items()}
        pairs = [[_wire(key, depth + 1), _wire(item, depth + 1)] for key, item in value.items()]
        return msgspec.msgpack.Ext(_PAIRS, _encoder.encode(pairs))
    if (code := _CONTAINERS.get(kind)) is not None:
        return msgspec.msgpack.Ext(code, _encoder.encode([_wire(v, depth + 1) for v in value]))
    if kind is datetime.datetime:
        return _datetime(value)
    if kind is datetime.time:
        return _time(value)
    ext = _TO_EXT.get(kind)
    if ext is not None:
        return msgspec.msgpack.Ext(ext[0], ext[1](value))
    if isinstance(value, HttpResponse):
        return msgspec.msgpack.Ext(_RESPONSE, _response(value))
    raise UncacheableValue(
        f"can't cache a {kind.__module__}.{kind.__qualname__}: layered_cache never pickles "
        "(reading the cache must not run code); cache str, bytes, int, float, bool, None, "
        "list, tuple, dict, set, frozenset, Decimal, UUID, datetime, date, time, "
        "timedelta, SafeString or HttpResponse (docs/django.md#values)"
    )


def dumps(value: Any) -> bytes:
    """``value`` as bytes; raises ``UncacheableValue`` for one that can't come back as
    it went in, before anything is written."""
    try:
        return _encoder.encode(_wire(value))
    except (UnicodeEncodeError, ValueError, OverflowError, RecursionError) as exc:
        # A lone surrogate, an int of more digits than str() writes: not storable.
        problem = f"can't cache this value: {type(exc).__name__}: {exc}"[:300]
        raise UncacheableValue(problem) from exc


def _from_response(data: memoryview) -> HttpResponse:
    status, reason, charset, headers, content, cookies = _decoder.decode(data)
    response = HttpResponse(content, status=status, reason=reason, charset=charset)
    stored = {str(name).lower() for name, _ in headers}
    for name in [name for name in response.headers if name.lower() not in stored]:
        del response.headers[name]  # the Content-Type HttpResponse adds (a 304 has none)
    for name, header in headers:
        response.headers[name] = header
    for name, value, attributes in cookies:
        response.cookies[name] = value
        response.cookies[name].update(attributes)
    return response


def _timedelta(data: memoryview) -> datetime.timedelta:
    days, seconds, microseconds = _decoder.decode(data)
    return datetime.timedelta(days, seconds, microseconds)


_FROM_EXT: dict[int, Callable[[memoryview], Any]] = {
    _TUPLE: lambda data: tuple(_decoder.decode(data)),
    _SET: lambda data: set(_decoder.decode(data)),
    _FROZENSET: lambda data: frozenset(_decoder.decode(data)),
    _DECIMAL: lambda data: decimal.Decimal(bytes(data).decode()),
    _UUID: lambda data: uuid.UUID(bytes=bytes(data)),
    _DATETIME: lambda data: datetime.datetime.fromisoformat(bytes(data).decode()),
    _DATETIME_FOLD: lambda data: datetime.datetime.fromisoformat(bytes(data).decode()).replace(
        fold=1
    ),
    _TIME_FOLD: lambda data: datetime.time.fromisoformat(bytes(data).decode()).replace(fold=1),
    _DATE: lambda data: datetime.date.fromisoformat(bytes(data).decode()),
    _TIME: lambda data: datetime.time.fromisoformat(bytes(data).decode()),
    _TIMEDELTA: _timedelta,
    _SAFESTRING: lambda data: SafeString(bytes(data).decode()),
    _RESPONSE: _from_response,
    _BYTEARRAY: lambda data: bytearray(data),
    _PAIRS: lambda data: dict(_decoder.decode(data)),
    _BIGINT: lambda data: int(bytes(data)),
    _ZONED: _zoned,
}


def _ext_hook(code: int, data: memoryview) -> Any:
    decode = _FROM_EXT.get(code)
    if decode is None:
        raise msgspec.DecodeError(f"unknown extension type {code} in a Django cache value")
    return decode(data)


_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def loads(payload: bytes) -> Any:
    """The value of ``payload``; raises ``UndecodableValue`` for one it can't read.
    Any exception: a planted payload reaches msgspec's errors, the constructors' (a bad
    ISO date, UUID, Decimal, zone name), ``http.cookies``' (a response's cookies), a
    codec lookup (its charset) and ``RecursionError`` (nested deep)."""
    try:
        return _decoder.decode(payload)
    except Exception as exc:
        raise UndecodableValue(f"{type(exc).__name__}: {exc}"[:200]) from exc


def readable(payload: bytes) -> bool:
    """Whether ``loads`` reads ``payload`` (``has_key``, ``add``, ``touch``)."""
    try:
        loads(payload)
    except UndecodableValue:
        return False
    return True
