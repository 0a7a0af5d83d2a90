"""Small builders shared by the scenario tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from layered_cache import Config, LayeredCache, parse_config


def make_config(
    redis_url: str,
    prefix: str,
    namespaces: dict[str, dict[str, Any]] | None = None,
    **sections: Any,
) -> Config:
    """A config for tests: `book` by default, fast breaker, the given overrides."""
    redis_section = {
        "url": redis_url,
        "prefix": prefix,
        "timeout": "200ms",
        "connect_timeout": "200ms",
        "breaker": {"failures": 2, "reset": "300ms"},
    }
    redis_section.update(sections.pop("redis", {}))
    raw: dict[str, Any] = {
        "redis": redis_section,
        "namespaces": namespaces or {"book": {"key": "book:{id}"}},
        **sections,
    }
    return parse_config(raw, source="<test>", env={})


class CountingLoader:
    """A loader that counts its calls and can be slowed or made to fail."""

    def __init__(self, value: Any = "v", delay: float = 0.0) -> None:
        self.value = value
        self.delay = delay
        self.calls = 0
        self.error: Exception | None = None

    async def __call__(self) -> Any:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return self.value


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    timeout: float = 5.0,
    interval: float = 0.02,
) -> bool:
    """Poll ``check`` until true or timeout; returns the last result."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result or loop.time() >= deadline:
            return bool(result)
        await asyncio.sleep(interval)


def open_cache(config: Config, **kwargs: Any) -> LayeredCache:
    return LayeredCache.from_config(config, **kwargs)
