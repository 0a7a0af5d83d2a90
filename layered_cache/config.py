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
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

__all__ = [
    "ENV_OVERRIDES",
    "BackplaneConfig",
    "BreakerConfig",
    "Config",
    "ConfigError",
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


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names file, path and problem."""


class Duration(float):
    """Seconds, written in the file as "50ms", "5s", "10m", "1h" (or a plain number)."""


class Rate(float):
    """Events per second, written in the file as "200/s", "6000/m" (or a plain number)."""


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: object) -> Duration:
    """Parse "50ms" / "5s" / "10m" / "1h" / "1d" or a non-negative number of seconds."""
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


def _check_jitter(jitter: float) -> None:
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be >= 0 and < 1, got {jitter}")


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config table: immutable, unknown keys are errors (typos fail loudly)."""


class BreakerConfig(_Section, frozen=True):
    """Circuit breaker around Redis: open after `failures` errors in a row, retry after `reset`."""

    failures: int = 3
    reset: Duration = Duration(1.0)

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"failures must be >= 1, got {self.failures}")


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
    max_connections: int = 64
    breaker: BreakerConfig = BreakerConfig()

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"url must start with redis://, rediss:// or unix://, got {self.url!r}"
            )
        if self.timeout <= 0:
            raise ValueError("timeout must be > 0")
        for node in self.nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f'nodes: expected "host:port", got {node!r}')


class KafkaConfig(_Section, frozen=True):
    bootstrap_servers: str = "127.0.0.1:9092"
    topics: list[str] = msgspec.field(default_factory=lambda: ["catalog-events"])
    group_id: str = "cache-invalidator"
    dead_letter_topic: str = "catalog-events.dlq"
    client_id: str = "layered-cache-invalidator"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    max_batch: int = 1000
    max_event_bytes: int = 1_000_000
    health_port: int = 9464
    health_host: str = "0.0.0.0"  # bind address of the daemon's /healthz /readyz /metrics
    # Consumer-group timing and start position (the daemon; tests shorten the timeouts).
    auto_offset_reset: str = "earliest"
    session_timeout: Duration = Duration(10.0)
    heartbeat_interval: Duration = Duration(3.0)
    rebalance_timeout: Duration = Duration(10.0)
    retry_max_backoff: Duration = Duration(5.0)


class BackplaneConfig(_Section, frozen=True):
    """The Redis Stream that carries invalidated keys to every instance's L1."""

    enabled: bool = True
    stream: str = "layered_cache:invalidations"
    maxlen: int = 100_000
    block: Duration = Duration(1.0)

    def __post_init__(self) -> None:
        if self.maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {self.maxlen}")


class LoggingConfig(_Section, frozen=True):
    format: str = "console"  # or "json"
    level: str = "info"
    redact_keys: bool = False


class MetricsConfig(_Section, frozen=True):
    enabled: bool = True


class L1Config(_Section, frozen=True):
    ttl: Duration = Duration(5.0)
    jitter: float = 0.2
    max_entries: int = 10_000

    def __post_init__(self) -> None:
        _check_jitter(self.jitter)
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")
        if self.ttl <= 0:
            raise ValueError("ttl must be > 0")


class L2Config(_Section, frozen=True):
    ttl: Duration = Duration(600.0)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        _check_jitter(self.jitter)
        if self.ttl <= 0:
            raise ValueError("ttl must be > 0")


class HotConfig(_Section, frozen=True):
    """Hot-key replica sharding: static `keys` and/or detection above `threshold`."""

    replicas: int = 8
    threshold: Rate | None = None
    keys: list[str] = msgspec.field(default_factory=list)
    window: Duration = Duration(1.0)
    cooldown: Duration = Duration(10.0)

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 64:
            raise ValueError(f"replicas must be within 1..64, got {self.replicas}")


class StampedeConfig(_Section, frozen=True):
    lease_ttl: Duration = Duration(5.0)
    retry: list[Duration] = msgspec.field(
        default_factory=lambda: [Duration(0.05), Duration(0.15)]
    )
    max_wait: Duration = Duration(3.0)
    early_refresh_beta: float = 1.0
    load_timeout: Duration | None = None

    def __post_init__(self) -> None:
        if len(self.retry) != 2 or self.retry[0] > self.retry[1] or self.retry[1] <= 0:
            raise ValueError(
                'retry must be [min, max] with 0 <= min <= max, e.g. ["50ms", "150ms"]'
            )
        if self.early_refresh_beta < 0:
            raise ValueError("early_refresh_beta must be >= 0")
        if self.lease_ttl <= 0:
            raise ValueError("lease_ttl must be > 0")


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
    max_value_bytes: int = 1_000_000


class InvalidateTarget(_Section, frozen=True):
    """One key an event invalidates: template field -> event field (``{ id = "book_id" }``)."""

    namespace: str
    key: dict[str, str]


class EventRoute(_Section, frozen=True):
    type: str
    invalidate: list[InvalidateTarget]


class Config(_Section, frozen=True):
    redis: RedisConfig = RedisConfig()
    kafka: KafkaConfig = KafkaConfig()
    backplane: BackplaneConfig = BackplaneConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    namespaces: dict[str, NamespaceConfig] = msgspec.field(default_factory=dict)
    events: list[EventRoute] = msgspec.field(default_factory=list)
    source: str = "<memory>"


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
    _check_cross_references(config)
    return config


def _check_cross_references(config: Config) -> None:
    """Checks that span tables: templates compile, events name known namespaces/fields."""
    from layered_cache.keys import KeyTemplate  # local: keys imports nothing from here

    templates: dict[str, KeyTemplate] = {}
    for name, ns in config.namespaces.items():
        try:
            templates[name] = KeyTemplate(name, ns.key)
        except ValueError as exc:
            raise ConfigError(f"{config.source}: namespaces.{name}.key: {exc}") from None
    _check_disjoint_namespaces(config.source, {n: ns.key for n, ns in config.namespaces.items()})
    for index, route in enumerate(config.events):
        for t_index, target in enumerate(route.invalidate):
            path = f"events[{index}].invalidate[{t_index}]"
            template = templates.get(target.namespace)
            if template is None:
                raise ConfigError(
                    f"{config.source}: {path}.namespace: unknown namespace {target.namespace!r}"
                )
            missing = set(template.fields) - set(target.key)
            extra = set(target.key) - set(template.fields)
            if missing or extra:
                raise ConfigError(
                    f"{config.source}: {path}.key: must map exactly the template fields "
                    f"{sorted(template.fields)} of {target.namespace!r}"
                    f" (missing {sorted(missing)}, unknown {sorted(extra)})"
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
