"""Logging: structlog configured once for the whole process.

    from layered_cache._logs import configure_logging
    configure_logging(config.logging)     # JSON lines in production, console in dev

The format comes from ``logging.format`` ("json" or "console"); the environment variable
``LAYERED_CACHE_LOG_FORMAT`` wins over the config (``LAYERED_CACHE_LOG_LEVEL`` likewise),
so a container can switch to JSON without editing the file.

Every cache event carries ``namespace`` and ``key``. With ``logging.redact_keys = true``
the ``key``/``keys`` and ``tag``/``tags`` values are replaced by a short keyed hash
(``h:3f2a9c01d4e8``), and so is any of them quoted in another field of the same event
(an ``error`` text): the same key always gives the same hash within a deployment, so
events of one key can still be correlated, but the key itself (an e-mail, a user id)
never reaches the log. A tag is hashed like a key: it is a key of another namespace
(``user:{email}``) and carries the same customer data. Set
``LAYERED_CACHE_LOG_REDACT_SALT`` to a secret so that low-entropy keys (``book:42``)
can't be recovered by hashing guesses.

With ``redact_keys`` an exception's message is withheld too, its types kept (``L2Unavailable:
ConnectionError``): redis-py's messages quote the commands that failed with their
arguments (``Command # 1 (DEL {p:user:a@b.c}:lease) of pipeline caused error``), keys
that no ``key`` field names, so hashing can't find them. The library therefore logs an
exception as ``error=error_text(exc)`` (or the exception itself), never as an f-string
of its own; a traceback (``exc_info``) keeps its frames and loses its messages. (A
purger's error quotes no Redis command: it keeps its text, the keys in it hashed.)

Independently of key redaction, every value of every event (and the rendered traceback)
goes through the one redaction rule of ``layered_cache._redact``: credentials in URLs of
any shape and every secret of the loaded config are masked, so a failing connect never
logs a password.

Records of other libraries that use the standard ``logging`` module (redis-py, aiokafka)
go through the same processors and renderer, so the output is uniform.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import traceback
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

from layered_cache._config import LoggingConfig
from layered_cache._redact import redact, replace_quoted

__all__ = [
    "FORMAT_ENV",
    "LEVEL_ENV",
    "SALT_ENV",
    "ErrorText",
    "configure_logging",
    "error_text",
    "exception_types",
    "mask_url_credentials",
    "redact_event",
    "redact_key",
    "reset_logging",
]

FORMAT_ENV = "LAYERED_CACHE_LOG_FORMAT"
LEVEL_ENV = "LAYERED_CACHE_LOG_LEVEL"
SALT_ENV = "LAYERED_CACHE_LOG_REDACT_SALT"
_FORMATS = ("json", "console")
# ``channel``: a lease waiter's fill channel, ``{<key>}:filled``, names its key.
_REDACTED_FIELDS = ("key", "keys", "tag", "tags", "channel")
_configured = False
_handler: logging.Handler | None = None


def mask_url_credentials(text: str) -> str:
    """Kept for callers of the old name: the one redaction rule, ``redact.redact``."""
    return redact(text)


def redact_key(key: str, salt: bytes = b"") -> str:
    """A short, stable, keyed hash of a cache key: ``h:`` + 12 hex digits."""
    digest = hashlib.blake2b(key.encode(), digest_size=6, key=salt[:64]).hexdigest()
    return f"h:{digest}"


class ErrorText(str):
    """An exception as a log field: its ``Type: message`` text (a str, for every
    renderer and for ``structlog.testing.capture_logs``), plus its types alone, which
    the log shows instead with ``redact_keys`` (``_KeyRedactor``)."""

    types: str


def error_text(exc: BaseException, text: str | None = None) -> ErrorText:
    """``exc`` for an ``error=`` field: ``text`` (by default ``Type: message``), or its
    types only where keys are redacted: the one way the library logs an exception."""
    logged = ErrorText(f"{type(exc).__name__}: {exc}" if text is None else text)
    logged.types = exception_types(exc)
    return logged


def exception_types(exc: BaseException, limit: int = 4) -> str:
    """``L2Unavailable: ConnectionError``: the type of ``exc`` and of its causes (or
    contexts), without a message that may quote a key."""
    return ": ".join(type(each).__name__ for each in _chain(exc)[:limit])


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` then what it was raised from (or while handling), once each."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and all(cause is not seen for seen in chain):
        chain.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return chain


def _mask_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, BaseException):
        return redact(f"{type(value).__name__}: {value}")
    if isinstance(value, dict):
        return {key: _mask_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_value(item) for item in value]
    return value


def _mask_credentials(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
    """Every value of every event through the one redaction rule; runs last, after the
    exception is rendered (``exc_info`` -> ``exception`` text), so tracebacks too."""
    for name, value in event.items():
        if isinstance(value, str | BaseException | dict | list | tuple):
            event[name] = _mask_value(value)
    return event


# For a service's own structlog setup (docs/operations.md): put it before the renderer.
# The library, the CLI and the daemon use configure_logging, which already has it.
redact_event = _mask_credentials


def _redact_rendered(_logger: Any, _method: str, line: str) -> str:
    return redact(line)


class _KeyRedactor:
    """Processor: replace ``key``/``keys``/``tag``/``tags``/``channel`` by their keyed hashes, and
    those values wherever another string field of the event quotes them (an error
    raised by a purger or a client may name the key it failed on)."""

    def __init__(self, salt: bytes) -> None:
        self._salt = salt

    def __call__(self, _logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
        _withhold_messages(event)
        raw: list[str] = []
        for name in _REDACTED_FIELDS:
            value = event.get(name)
            if isinstance(value, str) and value:
                raw.append(value)
                event[name] = redact_key(value, self._salt)
            elif isinstance(value, list | tuple):
                raw += [item for item in value if isinstance(item, str) and item]
                event[name] = [
                    redact_key(item, self._salt) if isinstance(item, str) else item
                    for item in value
                ]
        if raw:
            self._hash_quoted(event, raw)
        return event

    def _hash_quoted(self, event: MutableMapping[str, Any], raw: list[str]) -> None:
        """Each raw value inside another string field becomes its hash; longest first,
        so a key holding another (``book:12`` and ``book:1``) is replaced whole."""
        for name, value in event.items():
            if name not in _REDACTED_FIELDS and isinstance(value, str):
                event[name] = replace_quoted(value, raw, self._hash)

    def _hash(self, value: str) -> str:
        return redact_key(value, self._salt)


def _withhold_messages(event: MutableMapping[str, Any]) -> None:
    """With ``redact_keys``: exceptions logged as their types only (see the module doc),
    whether given through ``error_text``, as the exception itself, or as ``exc_info``,
    whose traceback keeps its frames and loses its messages (and so does any other
    field of the event quoting them: ``error=f"{type(exc).__name__}: {exc}"``)."""
    exc = _logged_exception(event.pop("exc_info", None))
    for name, value in event.items():
        if isinstance(value, ErrorText):
            event[name] = value.types
        elif isinstance(value, BaseException):
            event[name] = exception_types(value)
    if exc is None:
        return
    chain = _chain(exc)
    whole = {f"{type(each).__name__}: {each}": exception_types(each) for each in chain}
    messages = [str(each) for each in chain]
    for name, value in event.items():
        if isinstance(value, str):
            event[name] = whole.get(value) or replace_quoted(value, messages, _elide)
    event["exception"] = _traceback_without_messages(exc)


def _elide(_message: str) -> str:
    return "..."


def _logged_exception(exc_info: Any) -> BaseException | None:
    """The exception of an ``exc_info`` field: True (the one being handled), the
    exception itself, or a ``sys.exc_info()`` tuple."""
    if exc_info is True:
        exc_info = sys.exc_info()
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        exc_info = exc_info[1]
    return exc_info if isinstance(exc_info, BaseException) else None


def _traceback_without_messages(exc: BaseException) -> str:
    """The traceback of ``exc`` and its causes, each ending in its type alone."""
    parts = [
        "Traceback (most recent call last):\n"
        + "".join(traceback.format_tb(each.__traceback__))
        + f"{type(each).__module__}.{type(each).__qualname__} (message withheld: redact_keys)\n"
        for each in reversed(_chain(exc))
    ]
    return "\nThe above led to:\n\n".join(parts)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time (test capture, redirection)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _resolve(config: LoggingConfig, env: Mapping[str, str]) -> tuple[str, int]:
    fmt = (env.get(FORMAT_ENV) or config.format).strip().lower()
    if fmt not in _FORMATS:
        raise ValueError(f"logging format must be one of {list(_FORMATS)}, got {fmt!r}")
    level_name = (env.get(LEVEL_ENV) or config.level).strip().upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(f"unknown logging level {level_name.lower()!r}")
    return fmt, level


def configure_logging(
    config: LoggingConfig | None = None,
    *,
    stream: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    force: bool = False,
) -> bool:
    """Configure structlog (and the stdlib root logger) once per process.

    The one logging setup of the library, the CLI and the daemon. Returns True if this
    call configured logging, False if it was already configured (pass ``force=True`` to
    reconfigure, e.g. in tests). ``stream`` defaults to stderr.
    """
    global _configured
    if _configured and not force:
        return False
    config = config or LoggingConfig()
    environ = os.environ if env is None else env
    fmt, level = _resolve(config, environ)
    salt = environ.get(SALT_ENV, "").encode() if config.redact_keys else None
    shared, final = _processors(fmt, salt)
    _install_root_handler(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=final),
        stream,
        level,
    )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: module-level loggers must follow a reconfiguration. Cache events
        # are rare (errors, fallbacks), so the lookup cost does not matter.
        cache_logger_on_first_use=False,
    )
    _configured = True
    return True


def _processors(fmt: str, salt: bytes | None) -> tuple[list[Any], list[Any]]:
    """(processors for every event - structlog's and stdlib records alike -, the
    formatter's final ones). ``salt`` None: keys are not redacted."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if salt is not None:
        shared.append(_KeyRedactor(salt))
    final: list[Any] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if fmt == "json":
        # Tracebacks become a string before redaction, so they are redacted too.
        shared += [structlog.processors.format_exc_info, _mask_credentials]
        final.append(structlog.processors.JSONRenderer())
    else:
        # The console renderer draws tracebacks itself: redact its finished line.
        shared.append(_mask_credentials)
        final += [structlog.dev.ConsoleRenderer(colors=False), _redact_rendered]
    return shared, final


def _install_root_handler(formatter: logging.Formatter, stream: TextIO | None, level: int) -> None:
    """Replace our previous root handler (not anyone else's) with one using ``formatter``."""
    global _handler
    handler: logging.Handler = (
        logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(level)
    _handler = handler


def reset_logging() -> None:
    """Undo ``configure_logging`` (structlog defaults, our root handler removed)."""
    global _configured, _handler
    if _handler is not None:
        logging.getLogger().removeHandler(_handler)
    _handler = None
    _configured = False
    structlog.reset_defaults()
