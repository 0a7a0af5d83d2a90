"""Repository shim: ``python -m consumers`` runs the daemon from a source checkout.

The daemon itself is ``layered_cache.daemon`` (``layered-cache daemon --config FILE``);
this package is not in the wheel, so it can't clash with a ``consumers`` package of your
own or the one on PyPI. See ``docs/daemon.md``.
"""

from layered_cache.daemon import Daemon, DaemonStartError, DaemonStats

__all__ = ["Daemon", "DaemonStartError", "DaemonStats"]
