"""The TOML configuration, validated with msgspec.

The file format is a tree of frozen msgspec Structs. Each section is decoded on its own
so that an error names the file *and* the dotted path of the bad value
(``namespaces.book.l2.ttl: expected a duration like "10m", got "ten"``); msgspec alone
would print ``$.namespaces[...].l2.ttl`` for keys of a table.

Connection settings can be overridden from the environment (``LAYERED_CACHE_REDIS_URL``
and friends, see ``ENV_OVERRIDES``) so the same file serves every deployment.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import warnings as _warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec

from layered_cache.keys import RESERVED_SEGMENT, KeyTemplate, validate_prefix
from layered_cache.redact import redact, redact_url, remember_secret, remember_url_secrets

__all__ = [
    "ENV_OVERRIDES",
    "BackplaneConfig",
    "BreakerConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "Duration",
    "EventRoute",
    "HotConfig",
    "InvalidateTarget",
    "KafkaConfig",
    "L1Config",
    "L2Config",
    "LoggingConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "Rate",
    "RedisConfig",
    "StaleConfig",
    "StampedeConfig",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_rate",
]


class ConfigWarning(UserWarning):
    """Accepted but probably wrong; also listed in ``Config.warnings``."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names file, path and problem.

    The message is redacted when the error is made (``redact``), so however it is
    printed later (CLI, daemon, a log line, a traceback) it carries no secret.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class Duration(float):
    """Seconds, written in the file as "50ms", "5s", "10m", "1h" (or a plain number)."""


class Rate(float):
    """Events per second, written in the file as "200/s", "6000/m" (or a plain number)."""


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


# Longer than any cache lifetime, far below what Redis (ms since the epoch in 64 bits)
# and the clock arithmetic can hold: "1e300" would make every fill fail.
MAX_DURATION = 10 * 365 * 86400.0
_MAX_DURATION_TEXT = "3650d"


def parse_duration(text: object) -> Duration:
    """Parse "50ms" / "5s" / "10m" / "1h" / "1d" or a non-negative number of seconds,
    at most ``MAX_DURATION`` (ten years)."""
    if isinstance(text, bool):
        raise ValueError(f'expected a duration like "10m", got {text!r}')
    if isinstance(text, int | float):
        seconds = float(text)
    elif isinstance(text, str) and (match := _DURATION_RE.match(text)):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
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
        per_second = float(match.group(1)) / _RATE_UNITS[match.group(2)]
    else:
        shown = f'"{text}"' if isinstance(text, str) else repr(text)
        raise ValueError(f'expected a rate like "200/s", got {shown}')
    if per_second < 0 or not math.isfinite(per_second):
        raise ValueError(f"expected a non-negative rate, got {text!r}")
    return Rate(per_second)


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is Duration:
        return parse_duration(obj)
    if typ is Rate:
        return parse_rate(obj)
    raise NotImplementedError(f"unsupported config type {typ!r}")


CACHE_INVALIDATE = "CacheInvalidate"  # the built-in event type (layered_cache.events)

# A check in ``__post_init__`` names its field with this mark; ``_convert`` moves the
# field into the dotted path (``namespaces.book.hot.window: must be > 0``).
_FIELD_MARK = "@field "


def _bad(field: str, problem: str) -> ValueError:
    return ValueError(f"{_FIELD_MARK}{field}: {problem}")


def _positive(section: msgspec.Struct, *fields: str) -> None:
    """Durations (and rates) that the runtime divides by, sleeps for, or passes to Redis
    or Kafka as a timeout: zero would spin, block forever or be refused."""
    for field in fields:
        value = getattr(section, field)
        if value is not None and value <= 0:
            raise _bad(field, f"must be > 0, got {value:g}")


def _check_jitter(jitter: float) -> None:
    if not 0.0 <= jitter < 1.0:
        raise _bad("jitter", f"must be >= 0 and < 1, got {jitter}")


AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=-1, le=65535)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config table: immutable, unknown keys are errors (typos fail loudly)."""


class BreakerConfig(_Section, frozen=True):
    """Circuit breaker around Redis: open after `failures` errors in a row, retry after `reset`."""

    failures: AtLeastOne = 3
    reset: Duration = Duration(1.0)

    def __post_init__(self) -> None:
        _positive(self, "reset")


def _url_problem(url: str) -> str | None:
    """What redis-py's ``from_url`` would refuse (its errors quote parts of the URL, so
    they are refused here, where the message is redacted)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return "must start with redis://, rediss:// or unix://"
    parsed = urlsplit(url)
    try:
        parsed.port  # noqa: B018 - the property raises for a port that is not 0..65535
    except ValueError:
        return (
            "the port must be a number within 0..65535 "
            "(a password containing '/' must be percent-encoded)"
        )
    if parsed.scheme == "unix":
        return None if parsed.path else "a unix:// URL needs the socket path"
    if not parsed.hostname:
        return "the URL has no host"
    database = parsed.path.strip("/")
    if database and not database.isdigit():
        return "the path must be a database number such as /0"
    return None


class RedisConfig(_Section, frozen=True):
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    # Cluster only: more "host:port" seeds besides the URL's node, so a client that
    # starts (or re-discovers the slot map) while that one node is down still connects.
    nodes: list[str] = msgspec.field(default_factory=list)
    timeout: Duration = Duration(0.1)
    connect_timeout: Duration = Duration(0.5)
    prefix: str = ""
    username: str | None = None  # Redis 6+ ACL user
    password: str | None = None  # prefer LAYERED_CACHE_REDIS_PASSWORD over the file
    ssl_ca_certs: str | None = None  # CA bundle for rediss:// (TLS)
    ssl_certfile: str | None = None  # client certificate (mutual TLS)
    ssl_keyfile: str | None = None
    # 0 would make every Redis call wait forever for a connection.
    max_connections: AtLeastOne = 64
    breaker: BreakerConfig = BreakerConfig()

    def __post_init__(self) -> None:
        if problem := _url_problem(self.url):
            raise _bad("url", f"{problem}, got {redact_url(self.url)!r}")
        _positive(self, "timeout", "connect_timeout")
        for node in self.nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise _bad("nodes", f'expected "host:port", got {redact(node)!r}')
        try:
            validate_prefix(self.prefix)
        except ValueError as exc:
            raise _bad("prefix", str(exc)) from None


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"]


class KafkaConfig(_Section, frozen=True):
    bootstrap_servers: NonEmpty = "127.0.0.1:9092"
    topics: Annotated[list[NonEmpty], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["catalog-events"]
    )
    group_id: NonEmpty = "cache-invalidator"
    dead_letter_topic: NonEmpty = "catalog-events.dlq"
    client_id: NonEmpty = "layered-cache-invalidator"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    max_batch: AtLeastOne = 1000
    max_event_bytes: AtLeastOne = 1_000_000
    # -1 = no health server, 0 = an ephemeral port.
    health_port: Port = 9464
    health_host: str = "0.0.0.0"  # bind address of the daemon's /healthz /readyz /metrics
    # Consumer-group timing and start position (the daemon; tests shorten the timeouts).
    auto_offset_reset: Literal["earliest", "latest", "none"] = "earliest"
    session_timeout: Duration = Duration(10.0)
    heartbeat_interval: Duration = Duration(3.0)
    rebalance_timeout: Duration = Duration(10.0)
    retry_max_backoff: Duration = Duration(5.0)

    def __post_init__(self) -> None:
        _positive(
            self, "session_timeout", "heartbeat_interval", "rebalance_timeout", "retry_max_backoff"
        )
        if self.heartbeat_interval >= self.session_timeout:
            raise _bad(
                "heartbeat_interval",
                f"must be shorter than session_timeout ({self.session_timeout:g}s), "
                "or the group evicts a healthy daemon",
            )


class BackplaneConfig(_Section, frozen=True):
    """The Redis Stream that carries invalidated keys to every instance's L1."""

    enabled: bool = True
    stream: str = "layered_cache:invalidations"
    maxlen: AtLeastOne = 100_000
    block: Duration = Duration(1.0)

    def __post_init__(self) -> None:
        if not self.stream.startswith(RESERVED_SEGMENT) or len(self.stream) > 128:
            # Keys can never start with the reserved segment (docs/keys.md), so a stream
            # inside it can never be a cache key that set() would overwrite.
            raise _bad(
                "stream", f"must start with the reserved {RESERVED_SEGMENT!r}, got {self.stream!r}"
            )
        _positive(self, "block")  # XREAD BLOCK 0 blocks forever


class LoggingConfig(_Section, frozen=True):
    format: Literal["console", "json"] = "console"
    level: str = "info"  # any case: LAYERED_CACHE_LOG_LEVEL=INFO is common
    redact_keys: bool = False

    def __post_init__(self) -> None:
        if self.level.strip().lower() not in LOG_LEVELS:
            raise _bad("level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")


class MetricsConfig(_Section, frozen=True):
    enabled: bool = True


class L1Config(_Section, frozen=True):
    ttl: Duration = Duration(5.0)
    jitter: float = 0.2
    max_entries: AtLeastOne = 10_000

    def __post_init__(self) -> None:
        _check_jitter(self.jitter)
        _positive(self, "ttl")


class L2Config(_Section, frozen=True):
    ttl: Duration = Duration(600.0)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        _check_jitter(self.jitter)
        _positive(self, "ttl")


class HotConfig(_Section, frozen=True):
    """Hot-key replica sharding: static `keys` and/or detection above `threshold`."""

    replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    threshold: Rate | None = None
    keys: list[NonEmpty] = msgspec.field(default_factory=list)
    window: Duration = Duration(1.0)
    cooldown: Duration = Duration(10.0)

    def __post_init__(self) -> None:
        # A zero threshold makes every key hot; a zero window divides by zero.
        _positive(self, "threshold", "window")


class StampedeConfig(_Section, frozen=True):
    lease_ttl: Duration = Duration(5.0)
    retry: list[Duration] = msgspec.field(default_factory=lambda: [Duration(0.05), Duration(0.15)])
    max_wait: Duration = Duration(3.0)
    early_refresh_beta: float = 1.0
    load_timeout: Duration | None = None

    def __post_init__(self) -> None:
        if len(self.retry) != 2 or self.retry[0] > self.retry[1] or self.retry[1] <= 0:
            raise _bad("retry", 'must be [min, max] with 0 <= min <= max, e.g. ["50ms", "150ms"]')
        if not 0 <= self.early_refresh_beta <= 100:
            raise _bad(
                "early_refresh_beta", f"must be within 0..100, got {self.early_refresh_beta}"
            )
        _positive(self, "lease_ttl", "load_timeout")


class StaleConfig(_Section, frozen=True):
    max_age: Duration = Duration(0.0)


class NamespaceConfig(_Section, frozen=True):
    key: str
    cache: bool = True
    l1: L1Config | bool = True
    l2: L2Config | bool = True
    hot: HotConfig | bool = False
    stampede: StampedeConfig = StampedeConfig()
    stale: StaleConfig = StaleConfig()
    max_value_bytes: AtLeastOne = 1_000_000


class InvalidateTarget(_Section, frozen=True):
    """One key an event invalidates: template field -> event field (``{ id = "book_id" }``)."""

    namespace: str
    key: dict[str, NonEmpty]


class EventRoute(_Section, frozen=True):
    type: NonEmpty
    invalidate: Annotated[list[InvalidateTarget], msgspec.Meta(min_length=1)]


class Config(_Section, frozen=True):
    redis: RedisConfig = RedisConfig()
    kafka: KafkaConfig = KafkaConfig()
    backplane: BackplaneConfig = BackplaneConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    namespaces: dict[str, NamespaceConfig] = msgspec.field(default_factory=dict)
    events: list[EventRoute] = msgspec.field(default_factory=list)
    source: str = "<memory>"
    # Accepted but probably wrong (an L1 TTL longer than the L2 TTL): shown by
    # ``layered-cache config check`` and issued as ``ConfigWarning``.
    warnings: list[str] = msgspec.field(default_factory=list)


# Environment variable -> (section, field). Values are strings; msgspec converts them
# with the same validation as the file (str_keys / strict=False for bools and ints).
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "LAYERED_CACHE_REDIS_URL": ("redis", "url"),
    "LAYERED_CACHE_REDIS_CLUSTER": ("redis", "cluster"),
    "LAYERED_CACHE_REDIS_PREFIX": ("redis", "prefix"),
    "LAYERED_CACHE_REDIS_USERNAME": ("redis", "username"),
    "LAYERED_CACHE_REDIS_PASSWORD": ("redis", "password"),
    "LAYERED_CACHE_REDIS_TIMEOUT": ("redis", "timeout"),
    "LAYERED_CACHE_REDIS_SSL_CA_CERTS": ("redis", "ssl_ca_certs"),
    "LAYERED_CACHE_KAFKA_BOOTSTRAP_SERVERS": ("kafka", "bootstrap_servers"),
    "LAYERED_CACHE_KAFKA_GROUP_ID": ("kafka", "group_id"),
    "LAYERED_CACHE_KAFKA_SECURITY_PROTOCOL": ("kafka", "security_protocol"),
    "LAYERED_CACHE_KAFKA_SASL_MECHANISM": ("kafka", "sasl_mechanism"),
    "LAYERED_CACHE_KAFKA_SASL_USERNAME": ("kafka", "sasl_username"),
    "LAYERED_CACHE_KAFKA_SASL_PASSWORD": ("kafka", "sasl_password"),
    "LAYERED_CACHE_LOG_FORMAT": ("logging", "format"),
    "LAYERED_CACHE_LOG_LEVEL": ("logging", "level"),
}

_Section_T = TypeVar("_Section_T", bound=msgspec.Struct)


def _convert(obj: Any, typ: type[_Section_T], path: str, source: str) -> _Section_T:
    """Convert one table, turning msgspec's ``- at `$.x`` into ``file: path.x: problem``."""
    try:
        return msgspec.convert(obj, typ, dec_hook=_dec_hook, strict=False)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$")
        where = where.rstrip("`")
        full = f"{path}{where}" if path else where.lstrip(".")
        # "Object contains unknown field `x`" is clearer with the field in the path.
        unknown = re.match(r"Object contains unknown field `(.+)`", message)
        if unknown:
            full = f"{full}.{unknown.group(1)}" if full else unknown.group(1)
            message = "unknown key (check the spelling against the config reference)"
        elif message.startswith(_FIELD_MARK):
            field, _, message = message[len(_FIELD_MARK) :].partition(": ")
            full = f"{full}.{field}" if full else field
        elif message.startswith("Object missing required field"):
            field = message.split("`")[1]
            full = f"{full}.{field}" if full else field
            message = "required key is missing"
        else:
            message = message[:1].lower() + message[1:]
        raise ConfigError(f"{source}: {full or '<top>'}: {message}") from None


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    for var, (section, field) in ENV_OVERRIDES.items():
        if var in env:
            table = merged.setdefault(section, {})
            if not isinstance(table, dict):
                continue  # reported by validation below
            table[field] = env[var]
    return merged


def parse_config(
    raw: Mapping[str, Any], source: str = "<memory>", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already parsed TOML document (a dict) and return the Config."""
    data = _apply_env(dict(raw), os.environ if env is None else env)
    _remember_secrets(data)
    sections: dict[str, Any] = {"source": source}
    known = {"redis", "kafka", "backplane", "logging", "metrics", "namespaces", "events"}
    for key in data:
        if key not in known:
            raise ConfigError(f"{source}: {key}: unknown top-level table")
    simple: dict[str, type[msgspec.Struct]] = {
        "redis": RedisConfig,
        "kafka": KafkaConfig,
        "backplane": BackplaneConfig,
        "logging": LoggingConfig,
        "metrics": MetricsConfig,
    }
    for name, typ in simple.items():
        if name in data:
            sections[name] = _convert(data[name], typ, name, source)
    namespaces = data.get("namespaces", {})
    if not isinstance(namespaces, dict):
        raise ConfigError(f"{source}: namespaces: expected a table of namespaces")
    sections["namespaces"] = {
        name: _convert(table, NamespaceConfig, f"namespaces.{name}", source)
        for name, table in namespaces.items()
    }
    events = data.get("events", [])
    if not isinstance(events, list):
        raise ConfigError(f"{source}: events: expected an array of tables ([[events]])")
    sections["events"] = [
        _convert(table, EventRoute, f"events[{index}]", source)
        for index, table in enumerate(events)
    ]
    config = Config(**sections)
    found = _check_cross_references(config)
    for warning in found:
        _warnings.warn(warning, ConfigWarning, stacklevel=2)
    return msgspec.structs.replace(config, warnings=found) if found else config


def _remember_secrets(data: Mapping[str, Any]) -> None:
    """Before any check can quote a value: every secret this config holds, whatever its
    shape, is masked in all later output (see ``layered_cache.redact``)."""
    redis_table = data.get("redis")
    if isinstance(redis_table, dict):
        remember_url_secrets(redis_table.get("url"))
        remember_secret(redis_table.get("password"))
        nodes = redis_table.get("nodes")
        for node in nodes if isinstance(nodes, list) else ():
            remember_url_secrets(node)
    kafka_table = data.get("kafka")
    if isinstance(kafka_table, dict):
        remember_secret(kafka_table.get("sasl_password"))
        remember_url_secrets(kafka_table.get("bootstrap_servers"))


def _check_cross_references(config: Config) -> list[str]:
    """Checks that span tables: templates compile, events name known namespaces and
    fields, each event type is routed once. Returns the warnings (not errors)."""
    source = config.source
    templates: dict[str, KeyTemplate] = {}
    for name, ns in config.namespaces.items():
        try:
            templates[name] = KeyTemplate(name, ns.key, config.redis.prefix)
        except ValueError as exc:
            raise ConfigError(f"{source}: namespaces.{name}.key: {exc}") from None
    _check_disjoint_namespaces(source, {n: ns.key for n, ns in config.namespaces.items()})
    for name, ns in config.namespaces.items():
        _check_static_hot_keys(source, name, ns)
    _check_routes(config, templates)
    return [
        warning
        for name, ns in config.namespaces.items()
        if (warning := _ttl_warning(source, name, ns))
    ]


def _check_routes(config: Config, templates: Mapping[str, KeyTemplate]) -> None:
    """What the daemon's event decoder would refuse at start, refused at load."""
    source = config.source
    seen: dict[str, int] = {}
    for index, route in enumerate(config.events):
        if route.type == CACHE_INVALIDATE:
            raise ConfigError(
                f"{source}: events[{index}].type: {CACHE_INVALIDATE!r} is built in and "
                "cannot be routed"
            )
        if route.type in seen:
            raise ConfigError(
                f"{source}: events[{index}].type: {route.type!r} is already routed by "
                f"events[{seen[route.type]}]; list all its targets in one route"
            )
        seen[route.type] = index
        for t_index, target in enumerate(route.invalidate):
            path = f"events[{index}].invalidate[{t_index}]"
            template = templates.get(target.namespace)
            if template is None:
                raise ConfigError(
                    f"{source}: {path}.namespace: unknown namespace {target.namespace!r}"
                )
            missing = set(template.fields) - set(target.key)
            extra = set(target.key) - set(template.fields)
            if missing or extra:
                raise ConfigError(
                    f"{source}: {path}.key: must map exactly the template fields "
                    f"{sorted(template.fields)} of {target.namespace!r}"
                    f" (missing {sorted(missing)}, unknown {sorted(extra)})"
                )


def _check_static_hot_keys(source: str, name: str, ns: NamespaceConfig) -> None:
    """``hot.keys`` are key names (without the prefix); one the template can never build
    would silently never be hot."""
    if not isinstance(ns.hot, HotConfig):
        return
    template = KeyTemplate(name, ns.key)
    for index, key in enumerate(ns.hot.keys):
        if template.parse(key) is None:
            raise ConfigError(
                f"{source}: namespaces.{name}.hot.keys[{index}]: {key!r} is not a key of "
                f"template {ns.key!r} (a ':' inside a value is written %3A, see docs/keys.md)"
            )


def _ttl_warning(source: str, name: str, ns: NamespaceConfig) -> str | None:
    """An L1 TTL above the L2 TTL is capped by the L2 soft expiry anyway: the setting
    does not do what it says, so say so (a warning: the cache still works)."""
    l1 = L1Config() if ns.l1 is True else ns.l1
    l2 = L2Config() if ns.l2 is True else ns.l2
    if not ns.cache or l1 is False or l2 is False or l1.ttl <= l2.ttl:
        return None
    return (
        f"{source}: namespaces.{name}.l1.ttl: {l1.ttl:g}s is longer than l2.ttl "
        f"{l2.ttl:g}s; L1 entries never outlive the L2 soft expiry, so the L1 TTL is "
        "effectively the L2 TTL"
    )


def _check_disjoint_namespaces(source: str, templates: dict[str, str]) -> None:
    """Two namespaces must never be able to produce the same key (one could then read or
    delete the other's values): their leading literals (``book:`` of ``book:{id}``) must
    be non-empty and neither may be a prefix of the other."""
    leads = {name: template.split("{", 1)[0] for name, template in templates.items()}
    for name, lead in leads.items():
        if not lead:
            raise ConfigError(
                f"{source}: namespaces.{name}.key: must start with literal text such as "
                f"'{name}:' so namespaces can't collide"
            )
        for other, other_lead in leads.items():
            if other != name and other_lead.startswith(lead):
                raise ConfigError(
                    f"{source}: namespaces.{other}.key: may produce the same keys as "
                    f"namespace {name!r} ({other_lead!r} starts with {lead!r}); give each "
                    "namespace its own leading text"
                )


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file; env overrides apply (see ENV_OVERRIDES)."""
    source = str(path)
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(raw, source=source, env=env)
