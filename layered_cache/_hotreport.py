"""Fleet-wide view of detected hot keys.

Detection runs in each instance's memory (``hotkeys.py``), so a separate process (the
``layered-cache hotkeys`` CLI, an operator) can't see it. Every instance with detection
on therefore writes its current hot keys, about once a second, to a hash of its own
(``{prefix}layered_cache:hotkeys:{instance}``) that expires a few seconds after the
instance stops writing; readers scan those hashes and add the rates up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from layered_cache._clients import REDIS_FAILURES, RedisClient, is_redis_failure
from layered_cache._keys import hot_report_name

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

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="layered_cache._hotreport")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(*REDIS_FAILURES):
            await self._client.delete(self._name)

    async def _run(self) -> None:
        while True:
            try:
                await self.report_once()
            except Exception as exc:
                if not is_redis_failure(exc):
                    raise  # a bug: the task fails loudly rather than reporting nothing
            await asyncio.sleep(self._interval)

    async def report_once(self) -> None:
        fields = {
            f"{namespace}{_SEP}{key}": f"{rate:.1f}"
            for namespace, keys in self._snapshot().items()
            for key, rate in keys.items()
        }
        # One name, one slot: the pipeline is a single round trip even in a cluster.
        pipe = self._client.pipeline(transaction=False)
        pipe.delete(self._name)
        if fields:
            pipe.hset(self._name, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(self._name, int(self._interval * 3000))
        await pipe.execute()


async def fleet_hot_keys(
    client: RedisClient, prefix: str
) -> dict[str, dict[str, dict[str, float]]]:
    """namespace -> key -> {"rate": summed reads/s, "instances": reporting instances}."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    pattern = hot_report_name(prefix, "*")
    async for name in client.scan_iter(match=pattern, count=500):
        for field, rate in (await client.hgetall(name)).items():
            text = field.decode() if isinstance(field, bytes) else str(field)
            namespace, _, key = text.partition(_SEP)
            entry = result.setdefault(namespace, {}).setdefault(key, {"rate": 0.0, "instances": 0})
            entry["rate"] += float(rate)
            entry["instances"] += 1
    return result
