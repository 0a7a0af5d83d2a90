"""A fill that fails never keeps its lease."""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as redis

from layered_cache import LayeredCache
from layered_cache.config import Duration, L2Config
from layered_cache.keys import lease_name
from tests.helpers import CountingLoader, make_config


async def test_a_fill_that_redis_refuses_releases_its_lease(redis_url: str, prefix: str) -> None:
    """A TTL Redis refuses (load validation forbids it; built here past validation) must
    not leave the lease held: the next reader would wait max_wait for nothing."""
    base = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "stampede": {"max_wait": "5s"}}}
    )
    book = msgspec.structs.replace(base.namespaces["book"], l2=L2Config(ttl=Duration(1e300)))
    config = msgspec.structs.replace(base, namespaces={"book": book})
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v")) == "v"
        assert await admin.exists(lease_name(f"{prefix}book:1")) == 0
        started = time.monotonic()
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("w")) == "w"
        assert time.monotonic() - started < 1.0
    await admin.aclose()
