"""layered_cache: L1 (in-process) + L2 (Redis) caching with stampede protection,
hot-key replica sharding and event-driven invalidation.

The public API is what this module exports (pinned by ``tests/test_public_api.py``),
plus three public subpackages/modules with optional dependencies: ``layered_cache.sync``
(also re-exported here), ``layered_cache.prometheus`` (extra ``prometheus``) and
``layered_cache.daemon`` (extra ``daemon``). Every other module is private: its names
may change in any release.
"""

from layered_cache.cache import LayeredCache, RedisStatus
from layered_cache.codec import CodecError
from layered_cache.config import Config, ConfigError, ConfigWarning, load_config, parse_config
from layered_cache.events import BookPriceChanged, CacheInvalidate, encode_event
from layered_cache.invalidation import ReplicaCountMismatch
from layered_cache.l2 import L2Unavailable
from layered_cache.logs import configure_logging
from layered_cache.namespace import Namespace
from layered_cache.sync import SyncLayeredCache
from layered_cache.tracing import instrument

__all__ = [
    "BookPriceChanged",
    "CacheInvalidate",
    "CodecError",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "L2Unavailable",
    "LayeredCache",
    "Namespace",
    "RedisStatus",
    "ReplicaCountMismatch",
    "SyncLayeredCache",
    "configure_logging",
    "encode_event",
    "instrument",
    "load_config",
    "parse_config",
]
__version__ = "0.1.0"
