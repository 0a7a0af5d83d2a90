"""TOML file -> validated ``Config``, with errors that name the file and dotted path.

Each table is decoded on its own so that an error names the file *and* the dotted path
of the bad value (``namespaces.book.l2.ttl: expected a duration like "10m", got
"ten"``); msgspec alone would print ``$.namespaces[...].l2.ttl`` for keys of a table.
"""

from __future__ import annotations

import os
import re
import tomllib
import warnings as _warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from layered_cache._config.checks import FIELD_MARK
from layered_cache._config.deprecated import old_name_in_error, rename_old_stampede_key
from layered_cache._config.env import ENV_OVERRIDES, apply_env, unknown_variables
from layered_cache._config.errors import ConfigError, ConfigWarning
from layered_cache._config.schema import (
    BackplaneConfig,
    Config,
    EventRoute,
    KafkaConfig,
    LoggingConfig,
    MetricsConfig,
    NamespaceConfig,
    PurgeConfig,
    RedisConfig,
)
from layered_cache._config.units import dec_hook
from layered_cache._config.validate import check_cross_references
from layered_cache._redact import remember_secret, remember_url_secrets

__all__ = ["convert", "load_config", "parse_config"]

_Section_T = TypeVar("_Section_T", bound=msgspec.Struct)

_TOP_LEVEL = {"redis", "kafka", "backplane", "logging", "metrics", "purge", "namespaces", "events"}
# Tables of the top level that are one struct each (namespaces and events are several).
_SIMPLE: dict[str, type[msgspec.Struct]] = {
    "redis": RedisConfig,
    "kafka": KafkaConfig,
    "backplane": BackplaneConfig,
    "logging": LoggingConfig,
    "metrics": MetricsConfig,
    "purge": PurgeConfig,
}


def convert(obj: Any, typ: type[_Section_T], path: str, source: str) -> _Section_T:
    """Convert one table, turning msgspec's ``- at `$.x`` into ``file: path.x: problem``."""
    try:
        return msgspec.convert(obj, typ, dec_hook=dec_hook, strict=False)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$")
        where = where.rstrip("`")
        full = f"{path}{where}" if path else where.lstrip(".")
        # "Object contains unknown field `x`" is clearer with the field in the path.
        unknown = re.match(r"Object contains unknown field `(.+)`", message)
        if unknown:
            full = f"{full}.{unknown.group(1)}" if full else unknown.group(1)
            message = "unknown key (check the spelling against the config reference)"
        elif message.startswith(FIELD_MARK):
            field, _, message = message[len(FIELD_MARK) :].partition(": ")
            full = f"{full}.{field}" if full else field
        elif message.startswith("Object missing required field"):
            field = message.split("`")[1]
            full = f"{full}.{field}" if full else field
            message = "required key is missing"
        else:
            message = message[:1].lower() + message[1:]
        raise ConfigError(f"{source}: {full or '<top>'}: {message}") from None


def parse_config(
    raw: Mapping[str, Any], source: str = "<memory>", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already parsed TOML document (a dict) and return the Config."""
    environ = os.environ if env is None else env
    data = apply_env(dict(raw), environ, source)
    _remember_secrets(data)
    deprecations: list[str] = []
    try:
        config = Config(**_decode_sections(data, source, deprecations))
    except ConfigError as exc:
        raise _from_environment(exc, source, environ) from None
    found = deprecations + check_cross_references(config) + unknown_variables(environ)
    for warning in found:
        _warnings.warn(warning, ConfigWarning, stacklevel=2)
    return msgspec.structs.replace(config, warnings=found) if found else config


def _from_environment(exc: ConfigError, source: str, env: Mapping[str, str]) -> ConfigError:
    """The error, naming the environment variable when the bad value came from one: the
    file may not even hold the option the message names."""
    message = str(exc)
    for var, (section, field) in ENV_OVERRIDES.items():
        if var in env and message.startswith(f"{source}: {section}.{field}:"):
            return ConfigError(f"{message} (from the environment: {var})")
    return exc


def _decode_sections(
    data: Mapping[str, Any], source: str, deprecations: list[str]
) -> dict[str, Any]:
    """Every top-level table decoded on its own (so errors name their path); a warning
    for each old key name found is appended to ``deprecations``."""
    sections: dict[str, Any] = {"source": source}
    for key in data:
        if key not in _TOP_LEVEL:
            raise ConfigError(f"{source}: {key}: unknown top-level table")
    for name, typ in _SIMPLE.items():
        if name in data:
            sections[name] = convert(data[name], typ, name, source)
    namespaces = data.get("namespaces", {})
    if not isinstance(namespaces, dict):
        raise ConfigError(f"{source}: namespaces: expected a table of namespaces")
    sections["namespaces"] = {
        name: _namespace(table, f"namespaces.{name}", source, deprecations)
        for name, table in namespaces.items()
    }
    events = data.get("events", [])
    if not isinstance(events, list):
        raise ConfigError(f"{source}: events: expected an array of tables ([[events]])")
    sections["events"] = [
        convert(table, EventRoute, f"events[{index}]", source) for index, table in enumerate(events)
    ]
    return sections


def _namespace(table: Any, path: str, source: str, deprecations: list[str]) -> NamespaceConfig:
    """One namespace table; an old key name in it is renamed first (``deprecated``), and
    an error about that value names the key as the file spells it."""
    table, deprecation = rename_old_stampede_key(table, path, source)
    if deprecation is None:
        return convert(table, NamespaceConfig, path, source)
    deprecations.append(deprecation)
    try:
        return convert(table, NamespaceConfig, path, source)
    except ConfigError as exc:
        raise old_name_in_error(exc, path) from None


def _remember_secrets(data: Mapping[str, Any]) -> None:
    """Before any check can quote a value: every secret this config holds, whatever its
    shape, is masked in all later output (see ``layered_cache._redact``)."""
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
    backplane_table = data.get("backplane")
    if isinstance(backplane_table, dict):
        remember_url_secrets(backplane_table.get("relay"))
    purge_table = data.get("purge")
    urls = purge_table.get("urls") if isinstance(purge_table, dict) else None
    for url in urls if isinstance(urls, list) else ():
        remember_url_secrets(url)


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file; env overrides apply (see ENV_OVERRIDES)."""
    source = str(path)
    file = Path(path)
    try:
        # A FIFO (or a device) is read until its writer closes it: it hung the CLI.
        if file.exists() and not file.is_file() and not file.is_dir():
            raise ConfigError(f"{source}: cannot read: not a regular file")
        text = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        # utf-8-sig: an editor's byte-order mark is no reason to refuse the file.
        raw = tomllib.loads(text.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(raw, source=source, env=env)
