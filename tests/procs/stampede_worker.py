"""One OS process of the cross-process stampede tests.

Usage: python -m tests.procs.stampede_worker URL PREFIX ID CONCURRENCY DELAY START_AT [LEASE_TTL]

Waits until wall-clock START_AT (a shared start line for all processes), fires
CONCURRENCY get_or_load calls for one key, counts loads in Redis (INCR) so the test sees
the fleet-wide total, and prints one JSON line with the values and wait times.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import redis.asyncio as redis

from layered_cache import LayeredCache
from tests.helpers import make_config


async def main(argv: list[str]) -> None:
    url, prefix, key_id, concurrency, delay, start_at = argv[:6]
    lease_ttl = argv[6] if len(argv) > 6 else "5s"
    config = make_config(
        url,
        prefix,
        {"book": {"key": "book:{id}", "stampede": {"lease_ttl": lease_ttl, "max_wait": "10s"}}},
    )
    counter = redis.Redis.from_url(url)

    async def loader() -> dict[str, object]:
        await counter.incr(f"{prefix}loads")
        await asyncio.sleep(float(delay))
        return {"id": int(key_id), "title": "Dune"}

    async with LayeredCache.from_config(config) as cache:
        await asyncio.sleep(max(0.0, float(start_at) - time.time()))

        async def timed() -> tuple[object, float]:
            started = time.perf_counter()
            value = await cache.get_or_load("book", {"id": int(key_id)}, loader)
            return value, time.perf_counter() - started

        results = await asyncio.gather(*(timed() for _ in range(int(concurrency))))
        stats = cache.stats()["book"]
    await counter.aclose()
    print(
        json.dumps(
            {
                "values": [value for value, _ in results],
                "waits": [wait for _, wait in results],
                "stats": stats,
            },
            default=str,
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
