"""layered_cache: L1 (in-process) + L2 (Redis) caching with stampede protection,
hot-key replica sharding and event-driven invalidation.

The public API is what this module exports (pinned by ``tests/test_public_api.py``),
plus four public modules: ``layered_cache.sync`` (``SyncLayeredCache``, re-exported
here), ``layered_cache.cli`` (the ``layered-cache`` command), ``layered_cache.prometheus``
(extra ``prometheus``) and ``layered_cache.daemon`` (extra ``daemon``). Every module
whose name starts with ``_`` is private: its names may change in any release.
"""

from layered_cache._backplane import BackplaneStatus
from layered_cache._cache import LayeredCache, RedisStatus
from layered_cache._codec import CodecError
from layered_cache._config import Config, ConfigError, ConfigWarning, load_config, parse_config
from layered_cache._event_types import BookPriceChanged, CacheInvalidate, encode_event
from layered_cache._invalidation import ReplicaCountMismatch
from layered_cache._l2 import L2Unavailable
from layered_cache._logs import configure_logging, redact_event
from layered_cache._namespace import Namespace
from layered_cache._tracing import instrument
from layered_cache.sync import SyncLayeredCache

__all__ = [
    "BackplaneStatus",
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
    "redact_event",
]
__version__ = "0.1.0"
