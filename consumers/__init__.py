"""The invalidation daemon: Kafka events in, cache keys out (``python -m consumers``).

See ``docs/daemon.md`` for running it, its config keys, delivery semantics and metrics.
"""

from consumers.daemon import Daemon, DaemonStats

__all__ = ["Daemon", "DaemonStats"]
