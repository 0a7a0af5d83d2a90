"""Single-flight semantics, without Redis."""

from __future__ import annotations

import asyncio

import pytest

from layered_cache._singleflight import SingleFlight


async def test_concurrent_callers_share_one_call() -> None:
    flight: SingleFlight[int] = SingleFlight()
    calls = 0

    async def load() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return 7

    results = await asyncio.gather(*(flight.do("k", load) for _ in range(50)))
    assert calls == 1
    assert [value for value, _ in results] == [7] * 50
    assert sum(shared for _, shared in results) == 49


async def test_a_failure_fails_every_waiter_and_leaves_nothing_behind() -> None:
    flight: SingleFlight[int] = SingleFlight()

    async def broken() -> int:
        await asyncio.sleep(0.01)
        raise RuntimeError("db down")

    results = await asyncio.gather(
        *(flight.do("k", broken) for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    assert not flight.in_flight("k")

    async def fine() -> int:
        return 1

    assert await flight.do("k", fine) == (1, False)


async def test_cancelled_leader_does_not_fail_its_waiters() -> None:
    flight: SingleFlight[str] = SingleFlight()
    calls = 0

    async def load() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return "value"

    leader = asyncio.create_task(flight.do("k", load))
    await asyncio.sleep(0.01)
    waiters = [asyncio.create_task(flight.do("k", load)) for _ in range(3)]
    await asyncio.sleep(0.01)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert [value for value, _ in await asyncio.gather(*waiters)] == ["value"] * 3
    assert calls == 2  # the cancelled load and one fresh load for all the waiters


async def test_a_cancelled_waiter_is_cancelled_and_the_load_goes_on() -> None:
    flight: SingleFlight[str] = SingleFlight()

    async def load() -> str:
        await asyncio.sleep(0.03)
        return "value"

    leader = asyncio.create_task(flight.do("k", load))
    await asyncio.sleep(0.005)
    waiter = asyncio.create_task(flight.do("k", load))
    await asyncio.sleep(0.005)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await leader == ("value", False)
