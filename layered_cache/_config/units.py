"""Durations and rates as people write them ("50ms", "10m", "200/s") -> floats.

Kept apart from the schema because the CLI and tests parse and format these values on
their own, and because msgspec needs one decode hook that knows both types.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = [
    "MAX_DURATION",
    "Duration",
    "Rate",
    "dec_hook",
    "parse_duration",
    "parse_rate",
]


class Duration(float):
    """Seconds, written in the file as "50ms", "5s", "10m", "1h" (or a plain number);
    "50us" for the one setting measured in microseconds (``redis.busy_poll``)."""


class Rate(float):
    """Events per second, written in the file as "200/s", "6000/m" (or a plain number)."""


# The unit may be left out (seconds, per second), as for a bare number in the file: an
# environment variable (``LAYERED_CACHE_REDIS_TIMEOUT=0.5``) is always a string.
# ASCII only: ``\d`` also matched "５s" (fullwidth digits, which float() then read as 5).
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|d)?\s*$", re.ASCII)
_DURATION_UNITS = {"us": 0.000001, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|m|h))?\s*$", re.ASCII)
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


# Longer than any cache lifetime, far below what Redis (ms since the epoch in 64 bits)
# and the clock arithmetic can hold: "1e300" would make every fill fail.
MAX_DURATION = 10 * 365 * 86400.0
_MAX_DURATION_TEXT = "3650d"


def parse_duration(text: object) -> Duration:
    """Parse "50us" / "50ms" / "5s" / "10m" / "1h" / "1d" or a non-negative number of seconds,
    at most ``MAX_DURATION`` (ten years)."""
    if isinstance(text, bool):
        raise ValueError(f'expected a duration like "10m", got {text!r}')
    if isinstance(text, int | float):
        seconds = float(text)
    elif isinstance(text, str) and (match := _DURATION_RE.match(text)):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        shown = f'"{text}"' if isinstance(text, str) else repr(text)
        raise ValueError(f'expected a duration like "10m", got {shown}')
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"expected a non-negative duration, got {text!r}")
    if seconds > MAX_DURATION:
        raise ValueError(f"expected a duration of at most {_MAX_DURATION_TEXT}, got {text!r}")
    return Duration(seconds)


def parse_rate(text: object) -> Rate:
    """Parse "200/s" / "6000/m" or a non-negative number per second."""
    if isinstance(text, bool):
        raise ValueError(f'expected a rate like "200/s", got {text!r}')
    if isinstance(text, int | float):
        per_second = float(text)
    elif isinstance(text, str) and (match := _RATE_RE.match(text)):
        per_second = float(match.group(1)) / _RATE_UNITS[match.group(2) or "s"]
    else:
        shown = f'"{text}"' if isinstance(text, str) else repr(text)
        raise ValueError(f'expected a rate like "200/s", got {shown}')
    if per_second < 0 or not math.isfinite(per_second):
        raise ValueError(f"expected a non-negative rate, got {text!r}")
    return Rate(per_second)


def dec_hook(typ: type, obj: Any) -> Any:
    """msgspec's hook for the two types it can't decode itself."""
    if typ is Duration:
        return parse_duration(obj)
    if typ is Rate:
        return parse_rate(obj)
    raise NotImplementedError(f"unsupported config type {typ!r}")
