"""``layered-cache config check FILE [--json]``: validate a config file and print the
effective policies, every default filled in.

The report is built once (``effective_config``) and printed either as JSON or as text,
so the two can't disagree. Its sections are the config's own Structs rendered as
plain values (``"10m"``, not ``600.0``): field for field what a config file would say.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any, TextIO

import msgspec

from layered_cache._config import (
    Config,
    ConfigWarning,
    Duration,
    HotConfig,
    L1Config,
    L2Config,
    NamespaceConfig,
    Rate,
)
from layered_cache._config.validate import daemon_start_problem
from layered_cache._redact import redact, redact_url
from layered_cache.cli.common import CliError, format_duration, load, print_json

__all__ = [
    "CachedNamespace",
    "ConfigReport",
    "RouteReport",
    "TargetReport",
    "UncachedNamespace",
    "cmd_config_check",
    "effective_config",
    "effective_namespace",
]

Section = dict[str, Any]  # a config Struct rendered as plain values, printed generically


class UncachedNamespace(msgspec.Struct, frozen=True):
    """A namespace with ``cache = false``: always read live, no layers to show."""

    key: str
    cache: bool = False


class CachedNamespace(msgspec.Struct, frozen=True):
    """A cached namespace, every layer resolved: a section, or ``"off"``."""

    key: str
    cache: bool
    l1: Section | str
    l2: Section | str
    hot: Section | str
    stampede: Section
    stale: Section
    max_value_bytes: int
    tags: bool = False
    http: Section | str = "off"


class TargetReport(msgspec.Struct, frozen=True, omit_defaults=True):
    namespace: str | None = None
    key: dict[str, str] | None = None  # template field -> event field
    tag: str | None = None  # or a tag template: every entry carrying the tag


class RouteReport(msgspec.Struct, frozen=True):
    type: str
    invalidate: list[TargetReport]


class ConfigReport(msgspec.Struct, frozen=True):
    """The effective config, secrets masked (``***``)."""

    source: str
    warnings: list[str]
    redis: Section
    kafka: Section
    backplane: Section
    logging: Section
    metrics: Section
    purge: Section
    namespaces: dict[str, CachedNamespace | UncachedNamespace]
    events: list[RouteReport]


def _value(value: Any) -> Any:
    """A config value as a config file would write it: durations and rates as text,
    Structs as dicts of their fields."""
    if isinstance(value, Duration):
        return format_duration(value)
    if isinstance(value, Rate):
        return f"{value:g}/s"
    if isinstance(value, msgspec.Struct):
        return {name: _value(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list | tuple):
        return [_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _value(item) for key, item in value.items()}
    return value


def _layer(layer: msgspec.Struct | bool) -> Section | str:
    return _value(layer) if layer is not False else "off"


def effective_namespace(ns: NamespaceConfig) -> CachedNamespace | UncachedNamespace:
    """A namespace with every default filled in and ``true``/``false`` layers resolved."""
    if not ns.cache:
        return UncachedNamespace(ns.key)
    return CachedNamespace(
        key=ns.key,
        cache=True,
        l1=_layer(L1Config() if ns.l1 is True else ns.l1),
        l2=_layer(L2Config() if ns.l2 is True else ns.l2),
        hot=_layer(HotConfig() if ns.hot is True else ns.hot),
        stampede=_value(ns.stampede),
        stale=_value(ns.stale),
        max_value_bytes=ns.max_value_bytes,
        tags=ns.tags,
        http=_layer(ns.http if ns.http is not None else False),
    )


def effective_config(config: Config) -> ConfigReport:
    """The whole config as ``config check`` shows it; no password survives."""
    redis_section = _value(config.redis)
    redis_section["url"] = redact_url(config.redis.url)
    if config.redis.password is not None:
        redis_section["password"] = "***"
    kafka = _value(config.kafka)
    if config.kafka.sasl_password is not None:
        kafka["sasl_password"] = "***"
    purge = _value(config.purge)
    purge["urls"] = [redact_url(url) for url in config.purge.urls]
    return ConfigReport(
        source=config.source,
        warnings=list(config.warnings),
        redis=redis_section,
        kafka=kafka,
        backplane=_value(config.backplane),
        logging=_value(config.logging),
        metrics=_value(config.metrics),
        purge=purge,
        namespaces={name: effective_namespace(ns) for name, ns in config.namespaces.items()},
        events=[
            RouteReport(
                route.type,
                [
                    TargetReport(t.namespace, dict(t.key) if t.key else None, t.tag)
                    for t in route.invalidate
                ],
            )
            for route in config.events
        ],
    )


def _inline(value: Any) -> str:
    """A section on one line: ``ttl=5s jitter=0.2 retry=[50ms, 150ms]``."""
    if isinstance(value, dict):
        return " ".join(f"{key}={_inline(item)}" for key, item in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_inline(item) for item in value) + "]"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def _write_text(report: ConfigReport, config: Config, out: TextIO) -> None:
    def write(text: str) -> None:
        out.write(redact(text))

    write(
        f"{config.source}: OK ({len(config.namespaces)} namespaces, "
        f"{len(config.events)} event routes)\n"
    )
    for warning in config.warnings:
        write(f"warning: {warning}\n")
    sections = {"redis": report.redis, "kafka": report.kafka, "backplane": report.backplane,
                "logging": report.logging, "metrics": report.metrics,
                "purge": report.purge}  # fmt: skip
    for name, section in sections.items():
        write(f"[{name}] {_inline(section)}\n")
    for name, ns in report.namespaces.items():
        write(f"\n[namespaces.{name}] key={ns.key}\n")
        if not isinstance(ns, CachedNamespace):
            write("  cache = false (never cached: always read live)\n")
            continue
        layers = {"l1": ns.l1, "l2": ns.l2, "hot": ns.hot, "stampede": ns.stampede,
                  "stale": ns.stale, "http": ns.http}  # fmt: skip
        for layer, value in layers.items():
            write(f"  {layer}: {_inline(value)}\n")
        write(f"  max_value_bytes: {ns.max_value_bytes}\n")
        write(f"  tags: {_inline(ns.tags)}\n")
    for route in report.events:
        targets = ", ".join(
            f"tag {t.tag}" if t.tag else f"{t.namespace}({_inline(t.key or {})})"
            for t in route.invalidate
        )
        write(f"\n[events] {route.type} -> {targets}\n")


def cmd_config_check(args: argparse.Namespace, out: TextIO) -> int:
    """Exit 0 when the cache and the daemon would start with the file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # shown below, once, as `warning:`
        config = load(args.file)
    # Checked here and at the daemon's start, not at every load: the services read the
    # same file and have no use for the daemon's Kafka password or CA file.
    if problem := daemon_start_problem(config.kafka):
        raise CliError(f"{config.source}: {problem}")
    report = effective_config(config)
    if args.json:
        print_json(report, out)
    else:
        _write_text(report, config, out)
    return 0
