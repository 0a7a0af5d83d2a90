"""Deterministic cost accounting for async paths: event-loop iterations, tasks and
timers per operation, counted with cProfile. Unlike wall time these counts do not move
when the machine is busy, so they show *where* an async path spends its overhead."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["loop_work"]

_FUNCS = {"_run_once": "loop iterations", "create_task": "tasks created", "call_at": "timers"}


async def loop_work(op: Callable[[], Awaitable[Any]], n: int = 300) -> dict[str, float]:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        await op()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    counts = dict.fromkeys(_FUNCS.values(), 0.0)
    for (_file, _line, func), (_cc, ncalls, *_rest) in stats.items():
        if func in _FUNCS:
            counts[_FUNCS[func]] += ncalls / n
    return counts
