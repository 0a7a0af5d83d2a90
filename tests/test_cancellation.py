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


# -- a loader that raises CancelledError itself ------------------------------------------


async def _cancelled_elsewhere() -> Any:
    """What a loader meets when it awaits a task someone else cancelled."""
    other = asyncio.create_task(asyncio.sleep(10))
    other.cancel()
    return await other


async def test_a_loader_raising_cancelled_error_is_a_load_error_not_the_callers_cancel(
    redis_url: str, prefix: str
) -> None:
    """The loader's CancelledError went up as if the caller had been cancelled: the
    caller's task ended cancelled, no load error was counted, and (below) the stale
    value the fail-safe keeps for a failing loader was not served."""
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        caller = asyncio.create_task(cache.get_or_load("book", {"id": 1}, _cancelled_elsewhere))
        with pytest.raises(RuntimeError, match="raised CancelledError without being cancelled"):
            await caller
        assert not caller.cancelled()
        stats = cache.stats()["book"]
        assert stats["load_error"] == 1
        # The lease went back: the next caller loads at once, not after max_wait.
        assert await asyncio.wait_for(cache.get_or_load("book", {"id": 1}, _value(7)), 2) == 7


async def test_a_loader_raising_cancelled_error_falls_back_to_the_stale_value(
    redis_url: str, prefix: str
) -> None:
    book = {"key": "book:{id}", "l1": False, "l2": {"ttl": "200ms"}, "stale": {"max_age": "60s"}}
    config = make_config(redis_url, prefix, {"book": book})
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 1}, _value("old")) == "old"
        await asyncio.sleep(0.5)  # past its soft expiry, within the stale window
        assert await cache.get_or_load("book", {"id": 1}, _cancelled_elsewhere) == "old"
        assert cache.stats()["book"]["stale_served"] == 1


async def test_a_batch_loader_raising_cancelled_error_is_a_load_error(
    redis_url: str, prefix: str
) -> None:
    async def load_many(fields: list[dict[str, object]]) -> list[Any]:
        return [await _cancelled_elsewhere()]

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        caller = asyncio.create_task(cache.get_or_load_many("book", [{"id": 1}], load_many))
        with pytest.raises(RuntimeError, match="raised CancelledError without being cancelled"):
            await caller
        assert not caller.cancelled()


def _value(value: Any) -> Callable[[], Awaitable[Any]]:
    async def load() -> Any:
        return value

    return load
