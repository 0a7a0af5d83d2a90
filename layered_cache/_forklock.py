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
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType

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


os.register_at_fork(after_in_child=_renew_all_in_child)
