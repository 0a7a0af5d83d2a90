"""The invalidation daemon: Kafka events in, cache keys out.

Run it with ``layered-cache daemon --config FILE``. It lives inside the library (not in
a top-level package of its own) so that no other package on ``sys.path`` - a service's
own ``consumers`` package, say - can shadow it. See ``docs/daemon.md``.
"""

from layered_cache.daemon.core import Daemon, DaemonStartError, DaemonStats

__all__ = ["Daemon", "DaemonStartError", "DaemonStats"]
