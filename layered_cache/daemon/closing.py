"""Closing the daemon's parts one after the other, each whatever became of the others.

A step that fails (a Kafka client's close with the broker gone) must not leave the
health port bound, the purges queued and Redis connected, nor skip ``daemon_stopped``.
Nor may a cancellation: an app that embeds the daemon cancels the task running
``Daemon.run()`` (its TaskGroup, its own shutdown), and a CancelledError let out of one
step skipped every later one. Each step is bounded (a Kafka close by ``STOP_TIMEOUT``),
so a cancellation that arrives while they run waits for the last one, then is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import structlog

from layered_cache._logs import error_text

__all__ = ["Step", "close_in_order"]

_log = structlog.get_logger("layered_cache.daemon")

#: A part's name and how to close it (None: nothing to close, it never started).
Step = tuple[str, Callable[[], Awaitable[None]] | None]


async def close_in_order(steps: Sequence[Step]) -> None:
    """Run every step; a failure is logged (``shutdown_step_failed``) and the next runs.

    Raises CancelledError at the end if this task was cancelled while the steps ran
    (``Task.cancelling()`` grew: also when a client swallowed the cancel). One asked
    before they began is not raised here: that is ``run()``'s own cancellation, already
    on its way out through the ``finally`` that called us."""
    task = asyncio.current_task()
    requested = task.cancelling() if task is not None else 0
    for name, close in steps:
        if close is None:
            continue
        try:
            await close()
        except asyncio.CancelledError:
            # Ours (counted above, raised below) or a client's own (aiokafka re-raises
            # the cancel of a task it cancels): either way the next part still closes.
            _log.warning("shutdown_step_interrupted", step=name)
        except Exception as exc:
            _log.warning("shutdown_step_failed", step=name, error=error_text(exc))
    if task is not None and task.cancelling() > requested:
        raise asyncio.CancelledError
