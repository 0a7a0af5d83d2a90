"""The TOML configuration, validated with msgspec.

The file format is a tree of frozen msgspec Structs (``schema``). Loading (``load``)
decodes each table on its own so an error names the file *and* the dotted path of the
bad value, then ``validate`` checks what spans tables. Durations and rates are parsed in
``units``; connection settings can be overridden from the environment
(``LAYERED_CACHE_REDIS_URL`` and friends, see ``env.ENV_OVERRIDES``) so the same file
serves every deployment.

Every name is re-exported here: callers import from ``layered_cache._config`` and need
not know which module holds what.
"""

from __future__ import annotations

from layered_cache._config.checks import LOG_LEVELS
from layered_cache._config.env import ENV_OVERRIDES
from layered_cache._config.errors import ConfigError, ConfigWarning
from layered_cache._config.load import load_config, parse_config
from layered_cache._config.schema import (
    BackplaneConfig,
    BreakerConfig,
    Config,
    EventRoute,
    HotConfig,
    HttpConfig,
    InvalidateTarget,
    KafkaConfig,
    L1Config,
    L2Config,
    LoggingConfig,
    MetricsConfig,
    NamespaceConfig,
    PurgeConfig,
    RedisConfig,
    StaleConfig,
    StampedeConfig,
)
from layered_cache._config.units import MAX_DURATION, Duration, Rate, parse_duration, parse_rate
from layered_cache._config.validate import CACHE_INVALIDATE

__all__ = [
    "CACHE_INVALIDATE",
    "ENV_OVERRIDES",
    "LOG_LEVELS",
    "MAX_DURATION",
    "BackplaneConfig",
    "BreakerConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "Duration",
    "EventRoute",
    "HotConfig",
    "HttpConfig",
    "InvalidateTarget",
    "KafkaConfig",
    "L1Config",
    "L2Config",
    "LoggingConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "PurgeConfig",
    "Rate",
    "RedisConfig",
    "StaleConfig",
    "StampedeConfig",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_rate",
]
