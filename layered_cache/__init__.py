"""layered_cache: L1 (in-process) + L2 (Redis) caching with stampede protection,
hot-key replica sharding and event-driven invalidation."""

from layered_cache.cache import LayeredCache
from layered_cache.codec import CodecError
from layered_cache.config import Config, ConfigError, ConfigWarning, load_config, parse_config
from layered_cache.invalidation import ReplicaCountMismatch
from layered_cache.l2 import L2Unavailable

__all__ = [
    "CodecError",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "L2Unavailable",
    "LayeredCache",
    "ReplicaCountMismatch",
    "load_config",
    "parse_config",
]
__version__ = "0.1.0"
