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

__all__ = ["Entry", "UncacheableValue", "UndecodableValue", "dumps", "loads"]


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
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _items(values: Any) -> bytes:
    return _encoder.encode([_wire(item) for item in values])


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
    return zone.tzname(None) == datetime.timezone(zone.utcoffset(None)).tzname(None)


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
        return msgspec.msgpack.Ext(_DATETIME, value.isoformat().encode())
    if type(zone) is zoneinfo.ZoneInfo and zone.key is not None:
        naive = value.replace(tzinfo=None).isoformat()
        return msgspec.msgpack.Ext(_ZONED, _encoder.encode([naive, zone.key, value.fold]))
    assert zone is not None
    raise _zone_refused(zone)


def _time(value: datetime.time) -> bytes:
    if not _fixed(value.tzinfo):  # a ZoneInfo time has no offset: it would come back naive
        assert value.tzinfo is not None
        raise _zone_refused(value.tzinfo)
    return value.isoformat().encode()


def _zoned(data: memoryview) -> datetime.datetime:
    naive, key, fold = _decoder.decode(data)
    moment = datetime.datetime.fromisoformat(naive)
    return moment.replace(tzinfo=zoneinfo.ZoneInfo(key), fold=fold)


_TO_EXT: dict[type, tuple[int, Callable[[Any], bytes]]] = {
    tuple: (_TUPLE, _items),
    set: (_SET, _items),
    frozenset: (_FROZENSET, _items),
    decimal.Decimal: (_DECIMAL, lambda v: str(v).encode()),
    uuid.UUID: (_UUID, lambda v: v.bytes),
    datetime.date: (_DATE, lambda v: v.isoformat().encode()),
    datetime.time: (_TIME, _time),
    datetime.timedelta: (
        _TIMEDELTA,
        lambda v: _encoder.encode([v.days, v.seconds, v.microseconds]),
    ),
    SafeString: (_SAFESTRING, lambda v: str.encode(v)),
    bytearray: (_BYTEARRAY, bytes),
}


def _wire(value: Any) -> Any:
    """``value`` as msgspec encodes it: plain types as they are, others as Ext."""
    kind = type(value)
    if kind in _PLAIN:
        if kind is int and not _INT_MIN <= value <= _INT_MAX:
            return msgspec.msgpack.Ext(_BIGINT, str(value).encode())
        return value
    if kind is list:
        return [_wire(item) for item in value]
    if kind is datetime.datetime:
        return _datetime(value)
    if kind is dict:
        if all(type(key) in _PLAIN for key in value):
            return {key: _wire(item) for key, item in value.items()}
        pairs = [[_wire(key), _wire(item)] for key, item in value.items()]
        return msgspec.msgpack.Ext(_PAIRS, _encoder.encode(pairs))
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
    return _encoder.encode(_wire(value))


def _from_response(data: memoryview) -> HttpResponse:
    status, reason, charset, headers, content, cookies = _decoder.decode(data)
    response = HttpResponse(content, status=status, reason=reason, charset=charset)
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


# What a payload that is not ours can make the decoders raise: msgspec's error, and the
# constructors' (a bad ISO date, UUID length, Decimal, zone name, response shape).
_BAD_PAYLOAD = (msgspec.DecodeError, ValueError, TypeError, KeyError, ArithmeticError)


def loads(payload: bytes) -> Any:
    """The value of ``payload``; raises ``UndecodableValue`` for one it can't read."""
    try:
        return _decoder.decode(payload)
    except _BAD_PAYLOAD as exc:
        raise UndecodableValue(f"{type(exc).__name__}: {exc}"[:200]) from exc
