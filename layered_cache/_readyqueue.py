"""Whether the event loop has other work queued right now.

Why: two hot paths skip an event-loop iteration when the loop is otherwise idle - the
yield after set()'s admission (``_writes``) and the one redis-py's per-send ``wait_for``
took (``_direct.HeldConnection``) - but must keep it in a burst. In a ``gather`` of many
calls every call's next step is already queued; a call that sends at once and starts its read
timeout would then wait for all of them to run before the loop reads its reply, and a
burst of our own making would time out its first commands. Each skipped iteration is a
round of syscalls (``epoll_wait`` among them), ~15 % of a set() on the bench VM.
"""

from __future__ import annotations

import asyncio

__all__ = ["others_are_ready", "ready_count"]


def others_are_ready() -> bool:
    """Whether callbacks other than the running one wait in the loop's ready queue.
    asyncio has no public way to ask; the default loop keeps the queue in ``_ready``
    (every CPython since 3.4). A loop without it (uvloop) counts as busy: the callers
    then keep their yields, as before."""
    return ready_count() != 0


def ready_count() -> int | None:
    """How many callbacks wait in the loop's ready queue; None on a loop that doesn't
    show it (uvloop), where the caller decides by other means."""
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    return None if ready is None else len(ready)
