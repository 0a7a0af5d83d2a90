"""Repository shim: the daemon is ``layered_cache.daemon``."""

from layered_cache.daemon import Daemon, DaemonStartError, DaemonStats

__all__ = ["Daemon", "DaemonStartError", "DaemonStats"]
