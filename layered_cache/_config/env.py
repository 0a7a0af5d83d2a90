"""Environment overrides of connection settings, so one file serves every deployment.

The values are strings put into the raw tables before validation: msgspec converts them
with the same checks as the file (``strict=False`` for bools and ints), and an error
names the same dotted path.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from layered_cache._config.errors import ConfigError

__all__ = ["ENV_OVERRIDES", "apply_env", "unknown_variables"]

# Environment variable -> (section, field).
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "LAYERED_CACHE_REDIS_URL": ("redis", "url"),
    "LAYERED_CACHE_REDIS_CLUSTER": ("redis", "cluster"),
    "LAYERED_CACHE_REDIS_PREFIX": ("redis", "prefix"),
    "LAYERED_CACHE_REDIS_USERNAME": ("redis", "username"),
    "LAYERED_CACHE_REDIS_PASSWORD": ("redis", "password"),
    "LAYERED_CACHE_REDIS_TIMEOUT": ("redis", "timeout"),
    "LAYERED_CACHE_REDIS_BUSY_POLL": ("redis", "busy_poll"),
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


# Overrides whose empty value is valid in the file but, set from the environment, is
# nearly always an unfilled placeholder (compose's ``${TENANT_PREFIX}``, a Helm value
# never set): an empty prefix would silently merge every tenant into one key space.
# Refused, as an empty LAYERED_CACHE_REDIS_URL is (by the URL's own validation).
_NOT_EMPTY = {
    "LAYERED_CACHE_REDIS_PREFIX": (
        "empty; unset the variable to keep the file's prefix (an empty prefix would "
        "share one key space with every other deployment on this Redis)"
    ),
}
# Read elsewhere (``_logs``): not an override of a config field, but ours all the same.
_OTHER_VARIABLES = frozenset({"LAYERED_CACHE_LOG_REDACT_SALT"})
_PREFIX = "LAYERED_CACHE_"


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``LAYERED_CACHE_*`` variable this version doesn't read: a typo
    (``LAYERED_CACHE_REDIS_PASWORD``) otherwise leaves the file's value in force and
    says nothing. Warned, not refused: a deployment may share the prefix for its own."""
    known = set(ENV_OVERRIDES) | _OTHER_VARIABLES
    warnings = []
    for var in sorted(name for name in env if name.startswith(_PREFIX) and name not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.append(f"environment: {var} is not a layered_cache setting, ignored{hint}")
    return warnings


def apply_env(
    raw: dict[str, Any], env: Mapping[str, str], source: str = "<memory>"
) -> dict[str, Any]:
    """``raw`` with the overrides set in ``env`` applied; ``raw``'s tables are copied,
    not changed (the caller's parsed document stays as the file says). An empty value
    of a ``_NOT_EMPTY`` variable is a ``ConfigError`` naming it."""
    for var, problem in _NOT_EMPTY.items():
        if env.get(var) == "":
            section, field = ENV_OVERRIDES[var]
            raise ConfigError(
                f"{source}: {section}.{field}: {problem} (from the environment: {var})"
            )
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    for var, (section, field) in ENV_OVERRIDES.items():
        if var in env:
            table = merged.setdefault(section, {})
            if not isinstance(table, dict):
                continue  # reported by validation below
            # Case-insensitive, as LAYERED_CACHE_LOG_LEVEL is: JSON means json.
            table[field] = env[var].lower() if var == "LAYERED_CACHE_LOG_FORMAT" else env[var]
    return merged
