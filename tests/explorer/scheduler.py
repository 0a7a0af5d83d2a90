"""Seeded random scheduling of the cache's awaits, with yield points outside the library.

The cache's races are between awaits: a Redis reply, a loader's database read, a
backplane delivery. The explorer makes each of those a *yield point* where a seeded
scheduler decides how long the task stands aside (a number of event-loop turns, now and
then a short real pause so that other tasks' replies arrive first) and whether the
command fails (before it reaches Redis, or after Redis ran it and the reply was lost).

Production code carries no hook, so the points cost nothing there: ``yield_points()``
patches redis-py's client classes (``execute_command`` and the pipelines' ``execute``),
and ``layered_cache._direct``'s ``execute_command``, ``execute_transaction`` and
``HeldConnection.execute`` (the commands the library packs itself), for the duration of an exploration, and only tasks whose context holds a ``Probe`` are
affected. The loaders of the explorer's world yield at their start and end themselves.

Determinism: a seed fixes the program (which operations, on which instance) and every
decision the scheduler makes, in the order the points are reached. Real I/O still
decides which task reaches its next point first, so a failing seed usually, not always,
fails again; the checker reports the full event trace of the failing schedule instead of
relying on replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import redis.asyncio.client as redis_client
import redis.asyncio.cluster as redis_cluster
from redis.exceptions import ConnectionError as RedisConnectionError

from layered_cache import _direct as direct
from layered_cache._refresh import Refresher
from layered_cache._singleflight import SingleFlight

__all__ = ["PROBE", "Probe", "Scheduler", "yield_points"]


class Scheduler:
    """The decisions of one schedule, all drawn from one seeded generator."""

    def __init__(
        self,
        seed: int,
        *,
        fault_rate: float = 0.0,
        max_turns: int = 6,
        pause_rate: float = 0.08,
        max_pause: float = 0.004,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.fault_rate = fault_rate
        self.max_turns = max_turns
        self.pause_rate = pause_rate
        self.max_pause = max_pause
        self.points = 0
        self.faults = 0
        self.outage = 0  # the next N commands all fail (opens breakers, makes probes)

    async def point(self, slow: float = 0.0) -> None:
        """Stand aside for a drawn number of loop turns (or a short real pause). With
        ``slow``, that chance of a longer pause (2-15 ms): used after the replies whose
        window matters most (a fill script, a set's pipeline), where an invalidation
        that lands before the caller resumes is the race being looked for."""
        self.points += 1
        if slow and self.rng.random() < slow:
            await asyncio.sleep(self.rng.uniform(0.002, 0.015))
            return
        if self.rng.random() < self.pause_rate:
            await asyncio.sleep(self.rng.uniform(0.0, self.max_pause))
            return
        for _ in range(self.rng.randrange(self.max_turns)):
            await asyncio.sleep(0)

    def fail(self) -> bool:
        if self.outage > 0:
            self.outage -= 1
            self.faults += 1
            return True
        if self.fault_rate and self.rng.random() < self.fault_rate:
            self.faults += 1
            return True
        return False


class Probe:
    """What the patched clients report to: the current schedule's scheduler and an
    observer of replies (the explorer's history). Long-lived: the caches' background
    tasks keep the context they were started in, so the probe outlives schedules and
    only its fields change between them."""

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.on_reply: Callable[[str, tuple[Any, ...], Any], None] | None = None
        self.trace: Callable[[str], None] | None = None


# The probe of the current task (None outside an exploration: the patch passes through).
PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("explorer_probe", default=None)

# The keys the current read joined another caller's in-process load for (single-flight):
# the read operation sets a fresh set, the patched SingleFlight adds to it. A context
# variable, not the task: a read under a client timeout runs in wait_for's own task,
# which copies the context (and so shares this set).
JOINED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "explorer_joined", default=None
)

# True inside the library's XFetch refresh task (``Refresher._refresh``, patched below) and
# the tasks it starts (they copy its context): the loads it runs are not the read's own,
# though they call the read's loader (``world.in_early_refresh``).
REFRESHING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "explorer_refreshing", default=False
)


# Replies after which the caller updates L1 (or returns from set()): the window where a
# concurrent invalidation must still win.
_WRITES = frozenset({"EVALSHA", "EVAL", "PIPELINE", "MULTI"})


def _command_name(args: tuple[Any, ...]) -> str:
    if not args:
        return "?"
    name = args[0]
    return (name.decode() if isinstance(name, bytes) else str(name)).upper()


def _wrap(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    async def yielding(self: Any, *args: Any, **kwargs: Any) -> Any:
        probe = PROBE.get()
        scheduler = probe.scheduler if probe is not None else None
        if probe is None or scheduler is None:
            return await original(self, *args, **kwargs)
        name = _command_name(args) if kind == "command" else kind.upper()
        await scheduler.point()
        if name != "XREAD" and scheduler.fail():
            _note(probe, f"fault before {name}")
            raise RedisConnectionError(f"explorer: {name} failed before reaching Redis")
        result = await original(self, *args, **kwargs)
        await scheduler.point(slow=0.25 if name in _WRITES else 0.0)
        if name != "XREAD" and scheduler.fail():
            # Redis ran it; the reply is lost (a timeout): the caller can't tell.
            _note(probe, f"fault after {name} (it ran)")
            raise RedisConnectionError(f"explorer: {name} ran but its reply was lost")
        if probe.on_reply is not None:
            probe.on_reply(name, args, result)
        return result

    return yielding


def _recording_do(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def do(self: Any, key: str, fn: Callable[[], Any]) -> tuple[Any, bool]:
        result, shared = await original(self, key, fn)
        joined = JOINED.get()
        if shared and joined is not None:
            joined.add(key)
        return result, shared

    return do


def _recording_claim(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def claim(self: Any, keys: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        ours, theirs = original(self, keys)
        joined = JOINED.get()
        if joined is not None:
            joined.update(theirs)  # a join that falls back to its own load counts too
        return ours, theirs

    return claim


def _marking_refresh(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def _refresh(self: Any, *args: Any, **kwargs: Any) -> Any:
        REFRESHING.set(True)  # in the refresh task's own context: the read's is untouched
        return await original(self, *args, **kwargs)

    return _refresh


def _note(probe: Probe, text: str) -> None:
    if probe.trace is not None:
        probe.trace(text)


@contextlib.contextmanager
def yield_points() -> Iterator[None]:
    """Patch redis-py's async clients so every command is a yield point (and a possible
    fault) for tasks running under a ``Probe``, and ``SingleFlight`` so that reads know
    which keys they joined (``JOINED``), and ``Refresher`` so that loads know whether
    they run for an early refresh (``REFRESHING``); restore them on exit."""
    flight_saved = [(attr, SingleFlight.__dict__[attr]) for attr in ("do", "claim")]
    refresh_saved = Refresher.__dict__["_refresh"]
    targets = [
        (redis_client.Redis, "execute_command", "command"),
        (redis_client.Pipeline, "execute", "pipeline"),
        (redis_cluster.RedisCluster, "execute_command", "command"),
        (redis_cluster.ClusterPipeline, "execute", "pipeline"),
        (direct, "execute_command", "command"),  # GET and set()'s write on a single node
        (direct, "execute_transaction", "multi"),  # set_many's, a hot key's write
        (direct.HeldConnection, "execute", "command"),  # the listener's stream commands
    ]
    saved = [(cls, attr, vars(cls)[attr]) for cls, attr, _ in targets]
    try:
        for cls, attr, kind in targets:
            setattr(cls, attr, _wrap(vars(cls)[attr], kind))
        SingleFlight.do = _recording_do(SingleFlight.__dict__["do"])  # type: ignore[method-assign]
        SingleFlight.claim = _recording_claim(SingleFlight.__dict__["claim"])  # type: ignore[method-assign]
        Refresher._refresh = _marking_refresh(refresh_saved)  # type: ignore[method-assign]
        yield
    finally:
        Refresher._refresh = refresh_saved  # type: ignore[method-assign]
        for cls, attr, original in saved:
            setattr(cls, attr, original)
        for attr, original in flight_saved:
            setattr(SingleFlight, attr, original)
