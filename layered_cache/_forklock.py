"""A ``threading.Lock`` that a forked child gets back released: ``ForkSafeLock``.

Why: ``fork()`` copies a lock in whatever state it is in, and only the forking thread
goes on in the child. A lock another thread of the parent held at that moment (the
loop thread recording a load time, a scrape copying the histograms) stays held in the
child for good, and the child's first use of it blocks forever: a ``SyncLayeredCache``
inherited through ``gunicorn --preload`` or ``multiprocessing`` then timed out on every
call and its ``/metrics`` hung. Every ``ForkSafeLock`` is renewed in the child by one
``os.register_at_fork`` hook. The locks are tracked weakly: the hook keeps nothing
alive (registrations can't be removed).

What a lock guards was copied mid-update, at worst: a histogram row that misses one
observation, which is what the parent's own scrape would have seen a moment earlier.

One lock not ours is released too: structlog's per-file write lock
(``_release_structlog_write_locks``), which every loop thread takes to log.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from types import TracebackType
from typing import Any

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A non-reentrant lock, used with ``with``, released in a forked child."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _locks.add(self)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()

    def renew(self) -> None:
        """A new, released lock: the copy may be held by a thread the child lacks."""
        self._lock = threading.Lock()


_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _renew_all_in_child() -> None:
    for lock in list(_locks):  # the only thread left in the child: nothing adds meanwhile
        lock.renew()
    _release_structlog_write_locks()


def _release_structlog_write_locks() -> None:
    """structlog's default loggers (``PrintLogger``, ``WriteLogger``, ``BytesLogger``:
    what the library logs through unless ``configure_logging`` or the app set up
    another) serialize the lines written to a file with one lock per file,
    ``structlog._output.WRITE_LOCKS``. A parent thread inside a write at the fork (its
    loop thread logging to a slow pipe) left it held in the child, whose new loop thread
    then blocked forever at its first log line: the child's cache never started. Held
    ones are released, not replaced: a logger cached on first use keeps the lock object
    itself. Private structlog API (as of structlog 26.1), so looked up and skipped if
    it is gone; a lock of another kind is replaced in the table instead."""
    output: Any = sys.modules.get("structlog._output")
    locks = getattr(output, "WRITE_LOCKS", None)
    if locks is None:
        return  # structlog not imported (nothing was logged through it) or changed
    plain = type(threading.Lock())
    for file, lock in list(locks.items()):
        if not isinstance(lock, plain):
            locks[file] = threading.Lock()  # another kind: at least new loggers go on
        elif lock.locked():
            lock.release()  # a plain Lock has no owner: the child's thread may release it


os.register_at_fork(after_in_child=_renew_all_in_child)
