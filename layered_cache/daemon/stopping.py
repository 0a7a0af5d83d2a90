"""Kafka calls that give way to ``stop()``.

aiokafka keeps at many of its calls for as long as the broker does not answer: a poll
while the group rebalances (for ever if the broker died), a commit (``commit_offsets``
retries a retriable error with no deadline), a send's wait for its topic's metadata
(``request_timeout_ms``, 40 s), a client's bootstrap (40 s a request to a broker that
accepts connections and never answers). Awaited as they are, a SIGTERM in such a
moment went unseen until the SIGKILL: no ``daemon_stopped``, nothing closed.

``unless_stopped`` runs such a call as a task of its own and gives it up (cancels it)
once ``stopping`` is set and ``grace`` more seconds have passed: at once for a call with
nothing to finish (a poll, a connect), ``STOP_GRACE`` for the commit or the dead letters
of the batch in flight (SIGTERM finishes that batch: a broker that answers does so in
milliseconds). Giving up is safe: nothing is committed past a batch given up, and its
next owner reads it again (at-least-once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["STOP_GRACE", "Stopped", "unless_stopped"]

T = TypeVar("T")

#: How long the commit or the dead letters of the batch in flight may still take once
#: ``stop()`` is called (a SIGTERM's grace is 30 s, and closing the clients comes next).
STOP_GRACE = 3.0


class Stopped(Exception):
    """``stop()`` came first: the call was given up, its outcome unknown."""


async def unless_stopped(
    call: Callable[[], Awaitable[T]], stopping: asyncio.Event, grace: float = 0.0
) -> T:
    """``call()``'s result, or ``Stopped`` once ``stopping`` is set and ``grace`` seconds
    have passed, whichever comes first; ``call()``'s errors are raised as they are. Not
    started at all when ``stopping`` is set already and there is no grace."""
    if stopping.is_set() and grace <= 0:
        raise Stopped
    task = asyncio.ensure_future(call())
    try:
        await _until_stopped(task, stopping, grace)
    except BaseException:
        task.cancel()  # this task cancelled: so is the call
        raise
    if task.done():
        return task.result()  # a result that came with stop() is kept
    task.cancel()
    await asyncio.wait((task,))  # let it end; our own cancellation still gets through
    if not task.cancelled():
        task.exception()  # ended otherwise as it was cancelled: given up all the same
    raise Stopped


async def _until_stopped(task: asyncio.Future[T], stopping: asyncio.Event, grace: float) -> None:
    """Until ``task`` ends, or ``grace`` seconds after ``stopping`` is set."""
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not task.done() and grace > 0:
        await asyncio.wait((task,), timeout=grace)
