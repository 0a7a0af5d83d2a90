"""A namespace's values on their way into L2 and back: the envelope bytes, and what is
counted and logged when a value can't make the trip (not encodable, too large, not
decodable as the declared type, or foreign bytes found in Redis).

Callers return and keep in L1 the value decoded back from the bytes, not the loader's
object: a call must return the same type whichever layer answers it, and L2 hands out
what the codec decodes (without a declared type: dict for a dataclass, str for a
Decimal, UUID or date, list for a tuple or set). The decode happens once per fill or
set(), never on a hit (cost measured in the README, "Use").
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog

from layered_cache._codec import CodecError, Envelope
from layered_cache._logs import error_text
from layered_cache._policy import Policy

__all__ = ["Encoded", "decode", "encode", "recheck"]

_log = structlog.get_logger("layered_cache")


class Encoded(msgspec.Struct, frozen=True):
    """A value on its way into L2: its envelope bytes (None: not cacheable, counted and
    logged) and what the caller gets back, decoded from those bytes wherever they exist.
    A value too large to store comes back decoded too: without a declared type a
    dataclass came back as itself when too large and as a dict when stored, so one call
    changed type with the value's size."""

    data: bytes | None
    value: Any


def decode(policy: Policy, key: str, data: bytes | None) -> Envelope[Any] | None:
    """The envelope in ``data``; None for a miss or undecodable bytes (counted, logged:
    a foreign, truncated or old-format value is a miss, and the next fill overwrites it)."""
    if data is None:
        return None
    try:
        return policy.codec.decode(data)
    except CodecError as exc:
        policy.stats.decode_error += 1
        _log.warning("l2_value_undecodable", namespace=policy.name, key=key, error=error_text(exc))
        return None


def recheck(policy: Policy, data: bytes | None) -> Envelope[Any] | None:
    """Decode a second read of the same key; undecodable bytes were already counted and
    logged by this request's first read, so they aren't again."""
    if data is None:
        return None
    try:
        return policy.codec.decode(data)
    except CodecError:
        return None


def encode(
    policy: Policy,
    key: str,
    value: Any,
    now: float,
    soft_expiry: float,
    delta: float,
    tags: dict[str, str] | None = None,
) -> Encoded:
    """The envelope bytes and the value decoded back from them (see ``Encoded``)."""
    try:
        data = policy.codec.encode(value, now, soft_expiry, delta, tags)
    # OverflowError: ints over 64 bits; RecursionError: nested deeper than msgspec goes.
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        _not_cached(policy, "value_not_encodable", key, error=error_text(exc))
        return Encoded(None, value)
    try:
        decoded = policy.codec.decode(data).value
    except CodecError as exc:  # encodable, but not as the declared type: L2 readers
        _not_cached(policy, "value_not_decodable", key, error=error_text(exc))
        return Encoded(None, value)
    if len(data) > policy.max_value_bytes:
        _not_cached(policy, "value_too_large", key, size=len(data), limit=policy.max_value_bytes)
        return Encoded(None, decoded)
    return Encoded(data, decoded)


def _not_cached(policy: Policy, event: str, key: str, **details: object) -> None:
    """Count and log a value that can't be cached; the caller still gets it."""
    policy.stats.not_cached += 1
    _log.warning(event, namespace=policy.name, key=key, **details)
