"""Cancellation takes effect at the library's own awaits (issue 21, item 3).

redis-py sends commands through ``asyncio.wait_for`` when a socket timeout is set. On
Python 3.11 that ``wait_for`` returns the inner result when the cancellation lands just
as the send finishes, and the ``CancelledError`` is lost (CPython gh-86296): a task
looping on ``invalidate`` ran on forever after ``cancel()``. Each scenario here loops
one operation in 32 tasks against a real Redis, cancels them all at once, several rounds
at varied moments, and asserts that every task ends, cancelled, within a bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from layered_cache import LayeredCache
from tests.helpers import make_config

Operation = Callable[[LayeredCache, int], Awaitable[Any]]


async def _load(n: int) -> dict[str, int]:
    return {"n": n}


async def _load_many(fields: list[dict[str, object]]) -> list[dict[str, int]]:
    return [{"n": 0} for _ in fields]


OPERATIONS: dict[str, Operation] = {
    "set": lambda cache, i: cache.set("book", {"id": i % 4}, {"n": i}),
    "invalidate": lambda cache, i: cache.invalidate("book", {"id": i % 4}),
    "get": lambda cache, i: cache.get("book", {"id": i % 4}),
    "get_or_load": lambda cache, i: cache.get_or_load("book", {"id": i % 8}, lambda: _load(i)),
    "set_many": lambda cache, i: cache.set_many("book", [({"id": i % 4}, {"n": i})]),
    "get_many": lambda cache, i: cache.get_many("book", [{"id": 1}, {"id": 2}]),
    "get_or_load_many": lambda cache, i: cache.get_or_load_many(
        "book", [{"id": i % 8}, {"id": 9}], _load_many
    ),
    "invalidate_tag": lambda cache, i: cache.invalidate_tag(f"shelf:{i % 4}"),
}


async def _loop(cache: LayeredCache, operation: Operation, worker: int) -> None:
    i = worker
    while True:
        await operation(cache, i)
        i += 1


@pytest.mark.parametrize("name", sorted(OPERATIONS))
async def test_32_tasks_looping_on_an_operation_all_stop_when_cancelled(
    redis_url: str, prefix: str, name: str
) -> None:
    # The L1 is off for `book` so that every call reaches Redis: that is where the
    # cancellation used to be lost; an L1 hit has no await to be cancelled at.
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "l1": False}},
        # A socket timeout (redis-py sends through wait_for), patient for a busy machine.
        redis={"timeout": "2s", "connect_timeout": "2s"},
    )
    operation = OPERATIONS[name]
    async with LayeredCache.from_config(config) as cache:
        for round_ in range(5):
            tasks = [asyncio.create_task(_loop(cache, operation, w)) for w in range(32)]
            # Varied moments: some tasks are mid-send, some mid-read, some between calls.
            await asyncio.sleep(0.05 + 0.03 * round_)
            for task in tasks:
                task.cancel()
            done, pending = await asyncio.wait(tasks, timeout=10)
            for task in pending:  # never leave them looping into the next test
                task.cancel()
            assert not pending, f"{len(pending)} of 32 {name} tasks ignored cancel()"
            errors = [t.exception() for t in done if not t.cancelled()]
            assert errors == [], f"tasks ended with errors instead of cancelled: {errors[:3]}"
