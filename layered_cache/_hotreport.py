"""Fleet-wide view of detected hot keys.

Detection runs in each instance's memory (``hotkeys.py``), so a separate process (the
``layered-cache hotkeys`` CLI, an operator) can't see it. Every instance with detection
on therefore writes its current hot keys, about once a second, to a name of its own
(``{prefix}layered_cache:hotkeys:{instance}``) that expires a few seconds after the
instance stops writing; readers scan those names and add the rates up.

What a report costs Redis matters because every instance of the fleet sends it: one
``SET`` with an expiry per period (a msgpack map of ``namespace<TAB>key`` to reads/s,
replaced whole, so no DEL first), and nothing at all while the instance has no hot key
(the last report expires by itself; one DEL ends it early). It was a DEL every second
per instance, hot key or not, plus HSET and PEXPIRE when there was one (issue 20).
Readers also accept the hash of an older instance during a rolling upgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from layered_cache._clients import REDIS_FAILURES, RedisClient, is_redis_failure, stop_if_cancelled
from layered_cache._codec import UNDECODABLE
from layered_cache._keys import hot_report_name
from layered_cache._logs import error_text

__all__ = ["HotKeyReporter", "fleet_hot_keys"]

_log = structlog.get_logger("layered_cache.hotreport")
_SEP = "\t"  # namespace and key: keys never contain a tab (validated)


# The name is built in keys.py with every other name; the old name stays for callers.


class HotKeyReporter:
    """Background task writing ``snapshot()`` (namespace -> key -> reads/s) to Redis."""

    def __init__(
        self,
        client: RedisClient,
        name: str,
        snapshot: Callable[[], dict[str, dict[str, float]]],
        interval: float = 1.0,
    ) -> None:
        self._client = client
        self._name = name
        self._snapshot = snapshot
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self._reported = False  # whether our name may still hold a report

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="layered_cache._hotreport")

    def cancel(self) -> None:
        """Cancel the reporting without waiting (``LayeredCache.close`` cut short before or
        while ``stop`` ran: the clients are closed next, which it would reopen)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(*REDIS_FAILURES):
            await self._client.delete(self._name)

    async def _run(self) -> None:
        while True:
            stop_if_cancelled()
            try:
                await self.report_once()
            except Exception as exc:
                if not is_redis_failure(exc):
                    # A bug: said at error, with the traceback, and tried again next
                    # period. A task that ended here would stop reporting unseen.
                    _log.error("hot_report_error", error=error_text(exc), exc_info=exc)
            await asyncio.sleep(self._interval)

    async def report_once(self) -> None:
        rates = {
            f"{namespace}{_SEP}{key}": round(rate, 1)
            for namespace, keys in self._snapshot().items()
            for key, rate in keys.items()
        }
        if rates:
            report = msgspec.msgpack.encode(rates)
            await self._client.set(self._name, report, px=int(self._interval * 3000))
            self._reported = True
        elif self._reported:
            await self._client.delete(self._name)  # the last hot key cooled down
            self._reported = False


async def fleet_hot_keys(
    client: RedisClient, prefix: str
) -> dict[str, dict[str, dict[str, float]]]:
    """namespace -> key -> {"rate": summed reads/s, "instances": reporting instances}."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    pattern = hot_report_name(prefix, "*")
    async for name in client.scan_iter(match=pattern, count=500):
        for field, rate in (await _report(client, name)).items():
            namespace, _, key = field.partition(_SEP)
            entry = result.setdefault(namespace, {}).setdefault(key, {"rate": 0.0, "instances": 0})
            entry["rate"] += float(rate)
            entry["instances"] += 1
    return result


async def _report(client: RedisClient, name: Any) -> dict[str, float]:
    """One instance's report: a msgpack map, or the hash an older instance wrote."""
    kind = await client.type(name)
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind == "hash":
        raw = await client.hgetall(name)
        try:
            report = {_text(field): float(rate) for field, rate in raw.items()}
        except (UnicodeDecodeError, ValueError):
            return {}  # not a report: skipped, the CLI shows the others
    else:
        data: Any = await client.get(name) if kind == "string" else None
        if not isinstance(data, bytes):
            return {}  # expired meanwhile
        try:
            report = msgspec.msgpack.decode(data, type=dict[str, float])
        except UNDECODABLE:
            return {}  # not a report: skipped, the CLI shows the others
    # A rate is finite and not negative (``inf`` would make ``--json`` print invalid JSON).
    return {field: rate for field, rate in report.items() if 0.0 <= rate < math.inf}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
