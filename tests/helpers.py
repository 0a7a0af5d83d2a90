"""Small builders shared by the scenario tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from layered_cache import Config, LayeredCache, parse_config
from layered_cache._l1 import MISSING
from layered_cache._relay import Relay
from layered_cache._relay_upstream import Upstream


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


async def start_checks_done(admin: Any) -> None:
    """Wait until a cache's start-up checks reached ``admin``'s server (a Redis of the
    test's own): they run in the background (``_startup``), and the transaction check's
    MULTI/EXEC would otherwise land in a window a test counts commands in."""
    async def checked() -> bool:
        return "cmdstat_exec" in await admin.info("commandstats")

    assert await eventually(checked), "the cache's start-up checks never reached Redis"


def stall_listener(cache: LayeredCache) -> asyncio.Event:
    """Hold ``cache``'s backplane listener at its next XREAD until the returned gate is
    set (a stalled loop, a GC pause, a CPU-starved pod): connected, just not reading."""
    listener = cache._backplane
    assert listener is not None
    real, gate = listener._xread, asyncio.Event()

    async def held(after: bytes) -> Any:
        await gate.wait()
        return await real(after)

    listener._xread = held  # type: ignore[method-assign]
    return gate


def hold_fill_messages(pubsub: Any) -> tuple[asyncio.Event, asyncio.Event]:
    """A slow fill-notification reader (``FillNotifier._pubsub``): it reads a message off
    its socket, then holds it until ``release`` (a busy loop; nothing orders it with the
    backplane listener, which reads on another connection). Returns (held, release). Its
    ``get_message`` in progress (1 s timeout) still reads unheld."""
    real, held, release = pubsub.get_message, asyncio.Event(), asyncio.Event()

    async def slow(*args: Any, **kwargs: Any) -> Any:
        message = await real(*args, **kwargs)
        if message is not None and message["type"] == "message":
            held.set()
            await release.wait()
        return message

    pubsub.get_message = slow
    return held, release


def open_cache(config: Config, **kwargs: Any) -> LayeredCache:
    return LayeredCache.from_config(config, **kwargs)


class Starvation:
    """When the OS did not run this process: a sampling thread sleeps 5 ms at a time and
    records every overrun over 10 ms. A latency bound then subtracts the starvation that overlapped
    the call - what a busy machine took, not the code under test. A thread, not an
    asyncio task, on purpose: a library call that blocked the event loop would stall a
    task (and be excused) but not the thread, which gets the GIL within Python's 5 ms
    switch interval."""

    def __init__(self, tick: float = 0.005) -> None:
        self._tick = tick
        self._stalls: list[tuple[float, float]] = []  # (start, end), time.perf_counter
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Starvation:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _sample(self) -> None:
        while not self._stop.is_set():
            before = time.perf_counter()
            time.sleep(self._tick)
            after = time.perf_counter()
            overrun = after - before - self._tick
            if overrun > 0.010:  # beyond a GIL hand-over (5 ms switch interval) or two
                self._stalls.append((after - overrun, after))

    def within(self, start: float, end: float) -> float:
        """Seconds of starvation between ``start`` and ``end`` (perf_counter)."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in list(self._stalls))

    @property
    def total(self) -> float:
        return sum(e - s for s, e in list(self._stalls))

    @property
    def stalls(self) -> list[tuple[float, float]]:
        """Each stall as (start, end), time.perf_counter."""
        return list(self._stalls)


async def start_relay(
    config: Config,
    port: int = 0,
    *,
    upstream: str | None = None,
    keep: int = 10_000,
    clock: Callable[[], float] = time.time,
) -> tuple[Relay, str]:
    """A backplane relay for ``config``'s stream, in this process, following (it knows its
    place in the stream); returns it and the ``backplane.relay`` URL to give instances.
    ``clock``: Redis's time (this host's: the test Redis runs here)."""
    stream = config.redis.prefix + config.backplane.stream
    block = config.backplane.block
    relay = Relay(
        Upstream(config.redis, stream, block, url=upstream),
        stream,
        clock=clock,
        block=block,
        keep=keep,
        maxlen=config.backplane.maxlen,
    )
    host, bound = await relay.start("127.0.0.1", port)
    if not await eventually(lambda: relay.status().following, timeout=10):
        await relay.close()
        raise RuntimeError("the relay did not start following its stream in 10 s")
    return relay, f"redis://{host}:{bound}"


def in_l1(cache: LayeredCache, book_id: int) -> bool:
    """Whether ``cache``'s L1 holds book ``book_id`` (namespace ``book``, ``book:{id}``)."""
    l1 = cache.namespace("book").policy.l1
    assert l1 is not None
    return l1.get(cache.key("book", {"id": book_id})) is not MISSING
