"""The invalidation daemon: Kafka events in, cache keys out.

Run it with ``layered-cache daemon --config FILE``. It lives inside the library (not in
a top-level package of its own) so that no other package on ``sys.path`` - a service's
own ``consumers`` package, say - can shadow it. See ``docs/daemon.md``.

Its dependencies are the ``daemon`` extra (``pip install 'layered-cache[daemon]'``).
Without them, ``from layered_cache.daemon import Daemon`` raises an ImportError that
says so, and ``layered-cache daemon`` prints it in one line and exits 2: this package
itself still imports (``layered_cache.daemon.main`` must, to report it), only its
public names and the modules that need aiokafka fail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layered_cache._extras import missing_extra

__all__ = ["Daemon", "DaemonStartError", "DaemonStats"]

if TYPE_CHECKING:
    from layered_cache.daemon.core import Daemon, DaemonStartError, DaemonStats


def __getattr__(name: str) -> Any:
    """Resolves the public names on first use (PEP 562): see the module docstring."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from layered_cache.daemon import core
    except ImportError as exc:
        raise missing_extra("layered_cache.daemon", "daemon", exc) from exc
    value = getattr(core, name)
    globals()[name] = value  # resolved once: later lookups don't come back here
    return value
