"""A cache's life: started again after close() (a second lifespan of a module-level cache,
a new event loop), a start() its caller gave up on, a close() cut short, a fork after
close(), and what a cancelled write leaves for close() to wait for. Found by a review;
each failed before its fix."""

from __future__ import annotations

import asyncio
from typing import Any

from layered_cache import LayeredCache
from tests.helpers import make_config


async def test_a_cluster_set_cancelled_after_its_write_still_announces_when_close_follows(
    redis_cluster: Any, prefix: str
) -> None:
    """README, "Invalidation wins everywhere": "a write whose caller is cancelled or
    times out mid-way still completes what its first command began: `invalidate()` and
    `invalidate_tag()` finish their Redis steps in a task of their own, which `close()`
    waits for (up to 5 s) rather than cutting it between its DEL and its announcement,
    and a `set()` cancelled after its write ... (where the announcement is a round trip
    of its own: a cluster) announces in the background"; ``BackgroundTasks.ORPHAN_GRACE``:
    "How long ``close`` waits for a write a cancelled caller left running ... cut off
    between its DEL and its announcement, the fleet would keep the old value in L1
    until its TTL".

    The cancelled set()'s background announcement (``_writes._abandoned`` ->
    ``tasks.spawn``) is an ordinary task, not an orphan of ``to_completion``: the
    shutdown that follows the client's timeout (``close()``) gives it only
    ``grace=0.2`` s and cancels it before its XADD. L2 holds "new", instance b serves
    "old" from its L1 for the L1 TTL (60 s). The XADD is slowed by 0.5 s (a slow reply,
    or a slot of ``L2Store.slots`` under a burst), as in
    ``test_cancelled_writes.py::test_invalidation_left_running_by_a_cancelled_caller_is_cut_by_close``."""
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    config = make_config(
        redis_cluster.url, prefix, namespaces, redis={"cluster": True}, backplane={"block": "200ms"}
    )
    async with LayeredCache.from_config(config) as b:
        assert b._backplane is not None
        for _ in range(200):
            if b._backplane.connected.is_set():
                break
            await asyncio.sleep(0.025)
        a = LayeredCache.from_config(config)
        await a.start()
        try:
            await a.set("book", {"id": 1}, "old")
            for _ in range(200):  # b hears the set's own announcement first
                if b.backplane_status().entries_applied >= 1:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.025)
            assert await b.get("book", {"id": 1}) == "old"  # b's L1 holds it
            invalidator = a._rt.invalidator
            real = invalidator.announce
            announcing = asyncio.Event()

            async def slow_announce(keys: Any) -> bool:
                announcing.set()
                await asyncio.sleep(0.5)  # the XADD's reply (or a slot) is slow to come
                return await real(keys)

            invalidator.announce = slow_announce  # type: ignore[method-assign]
            writer = asyncio.ensure_future(a.set("book", {"id": 1}, "new"))
            await announcing.wait()  # the SET landed; the announcement is on its way
            writer.cancel()  # the client gave up
            await asyncio.gather(writer, return_exceptions=True)
        finally:
            await a.close()  # the app shuts down right after
        await asyncio.sleep(1.5)  # ~7 x the backplane's block time
        probe = LayeredCache.from_config(config)
        await probe.start()
        try:
            assert await probe.get("book", {"id": 1}) == "new"  # what L2 holds
        finally:
            await probe.close()
        served = await b.get("book", {"id": 1})
        assert served != "old", (
            "b serves 'old' from L1 while L2 holds 'new': the cancelled set()'s "
            "announcement was cancelled by close() after 0.2 s"
        )
