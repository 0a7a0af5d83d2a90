"""What every command shares: the error type and exit codes, loading the config, key
fields from the command line, JSON output, and how Redis failing halfway through a
command becomes one line instead of a traceback."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO, TypeVar

import msgspec
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError

from layered_cache._cache import LayeredCache
from layered_cache._config import Config, ConfigError, load_config
from layered_cache._l2 import L2Unavailable
from layered_cache._policy import Policy
from layered_cache._redact import redact, redact_data

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_PARTIAL",
    "CliError",
    "format_duration",
    "format_ms",
    "iso",
    "load",
    "parse_fields",
    "policy_of",
    "print_json",
    "printable",
    "refuse_uncached",
    "relative",
    "run",
    "why",
]

T = TypeVar("T")
EXIT_PARTIAL = 1  # warm: finished, but some entries failed (listed on stderr)
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (``| head -1``)
_INT = re.compile(r"-?[1-9][0-9]*|0")


class CliError(Exception):
    """Bad input or an unusable environment: printed without a traceback, exit 2."""


def printable(text: str) -> str:
    """``text`` for a terminal: control characters escaped (``\x1b`` as ``\\x1b``). What
    anyone with write access to Redis put in a value, a lease token or a hot-key report
    must not clear the operator's screen or forge a line of the report."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_duration(seconds: float) -> str:
    """``600.0`` -> ``"10m"``: durations read back the way a config file writes them,
    to 15 significant digits (``:g``'s 6 showed ``"1000001ms"`` as ``1000s``; 15 hide a
    float's last-digit noise, ``0.1 * 3``)."""
    if seconds == 0:
        return "0s"
    if seconds < 0.001:
        return f"{seconds * 1e6:.15g}us"
    if seconds < 1:
        return f"{seconds * 1000:.15g}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:.15g}{unit}"
    return f"{seconds:.15g}s"


def format_ms(pttl: int) -> str:
    """A PTTL reply for people: its two negative codes spelled out."""
    if pttl == -1:
        return "no expiry"
    if pttl == -2:
        return "missing"
    return f"{pttl / 1000:.1f}s"


def relative(seconds: float) -> str:
    """``"in 9.9m"`` / ``"1.8s ago"``: offsets from now, in the unit that reads best."""
    span = abs(seconds)
    text = (
        f"{span:.1f}s"
        if span < 120
        else f"{span / 60:.1f}m"
        if span < 7200
        else f"{span / 3600:.1f}h"
    )
    return f"in {text}" if seconds >= 0 else f"{text} ago"


def iso(timestamp: float) -> str:
    """UTC, milliseconds: envelope timestamps compared across hosts. One no calendar
    holds (a planted year 33658) is shown as the number it is, not an error."""
    try:
        return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError):
        return f"{timestamp!r} (not a date)"


def parse_fields(items: Sequence[str], policy: Policy) -> tuple[dict[str, object], str]:
    """``["id=42", "lang=en"]`` -> ({"id": 42, "lang": "en"}, full key), validated.

    Canonical integers become ints ("42" -> 42; "007" stays a string), so the key is
    built exactly as the service builds it from its typed fields."""
    fields: dict[str, object] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"expected field=value, got {item!r}")
        if name in fields:
            raise CliError(f"field {name!r} given twice")
        try:
            fields[name] = int(value) if _INT.fullmatch(value) else value
        except ValueError:  # more digits than Python turns into an int (4,300)
            raise CliError(f"field {name!r}: a number of {len(value):,} digits") from None
    template = policy.template
    unknown = sorted(set(fields) - set(template.fields))
    if unknown:
        raise CliError(
            f"namespace {policy.name!r}: unknown field(s) {unknown} "
            f"(template {template.template!r} has {list(template.fields)})"
        )
    return fields, _build_key(policy, fields)


def _build_key(policy: Policy, fields: dict[str, object]) -> str:
    try:
        return policy.template.build(fields)
    except (KeyError, ValueError) as exc:
        raise CliError(str(exc.args[0]) if exc.args else str(exc)) from None


def policy_of(cache: LayeredCache, namespace: str) -> Policy:
    """The namespace's policy; an unknown name is bad input (exit 2), not a crash."""
    try:
        return cache.namespace(namespace).policy
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None


def refuse_uncached(config: Config, namespace: str, command: str) -> None:
    """``inspect``/``invalidate`` of a namespace with ``cache = false`` is bad input (exit
    2), not a report of an absent key: nothing of it is ever in L1 or Redis. ``inspect``
    also refuses ``l2 = false``: Redis holds nothing of it (its L1 copies live in each
    instance's memory; ``invalidate`` still drops them everywhere). An unknown namespace
    is left to ``policy_of``, which lists the configured ones."""
    ns = config.namespaces.get(namespace)
    if ns is None:
        return
    if not ns.cache:
        raise CliError(
            f"namespace {namespace!r} is never cached (cache = false): every read goes to "
            f"the loader, so there is nothing to {command}"
        )
    if command == "inspect" and ns.l2 is False:
        raise CliError(
            f"namespace {namespace!r} has no L2 (l2 = false): its values live only in each "
            "instance's L1, so Redis holds nothing to inspect (`invalidate` still drops "
            "the L1 copies everywhere)"
        )


def load(path: str) -> Config:
    """The config file, its errors (file and dotted path) as a ``CliError``."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def print_json(report: Any, out: TextIO) -> None:
    """A report (Struct, or a dict/list of them) as indented JSON, every string redacted.

    ``to_builtins`` keeps the Structs' field names and order; ``json.dumps`` keeps the
    format scripts already parse (ASCII escapes, ``indent=2``)."""
    data = msgspec.to_builtins(report)
    out.write(json.dumps(redact_data(data), indent=2, sort_keys=False, default=str) + "\n")


def why(exc: BaseException) -> str:
    """``"ConnectionError: Error 111 ..."``, one line, any password masked."""
    text = f"{type(exc).__name__}: {exc}".rstrip(": .") if str(exc) else type(exc).__name__
    return redact(text)


def run(command: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, with Redis failing halfway through reported as a ``CliError``
    (one line, redacted) instead of a traceback. ``L2Unavailable`` (a read through the
    store) is reported by the Redis error it wraps, as the raw client's error was."""
    try:
        return asyncio.run(command)
    except L2Unavailable as exc:
        cause = exc.__cause__
        if isinstance(cause, ClusterDownError):
            raise _cluster_down(cause) from None
        raise CliError(f"Redis failed: {why(cause) if cause else redact(str(exc))}") from None
    except ClusterDownError as exc:
        raise _cluster_down(exc) from None
    except BrokenPipeError:  # our own output's reader went away: not Redis (cli.main)
        raise
    except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
        raise CliError(f"Redis failed: {why(exc)}") from None


def _cluster_down(exc: ClusterDownError) -> CliError:
    return CliError(
        f"Redis Cluster is down: {why(exc)}. With cluster-require-full-coverage yes "
        "(the Redis default) one dead master stops every key; cache clusters should "
        "run with `no` (docs/operations.md)"
    )
