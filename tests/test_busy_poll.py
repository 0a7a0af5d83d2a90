"""``redis.busy_poll``: a single node's request path polls its socket for a reply that is
microseconds away instead of sleeping for it (``_busypoll``). What must hold: replies
still arrive whole and to the command that asked; a Redis that answers slower than the
budget (another host) costs a handful of wasted polls per thousand commands, not one per
command; a busy event loop runs its other work instead of polling; ``0s`` turns it off."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as redis
import uvloop

from layered_cache import LayeredCache, parse_config
from layered_cache import _direct as direct
from layered_cache._busypoll import MAX_SKIP, BusyPoll, SocketPoll
from layered_cache.cli.common import format_duration
from tests.faults.proxy import ToxicProxy
from tests.helpers import make_config
from tests.servers import RedisServer

NO_L1 = {"book": {"key": "book:{id}", "l1": False}}  # every read goes to Redis
# A burst opens up to 64 connections at once: on a loaded 2-core CI machine their
# handshakes (HELLO, CLIENT SETINFO) can take longer than the tests' usual 200 ms.
BURST = {"busy_poll": "1ms", "connect_timeout": "2s", "timeout": "1s"}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, server = socket.socketpair()
    yield ours, server
    ours.close()
    server.close()


def _polls(cache: LayeredCache) -> BusyPoll:
    store_direct = cache._parts.store.direct
    assert store_direct is not None and store_direct.busy_poll is not None
    return store_direct.busy_poll


def test_a_reply_already_there_ends_the_spin_at_once(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, server = pair
    server.send(b"+OK\r\n")
    polls = BusyPoll(budget=5.0)
    started = time.monotonic()
    polls.wait(SocketPoll(ours.fileno()))
    assert time.monotonic() - started < 1.0
    assert (polls.spins, polls.misses) == (1, 0)


def test_a_server_slower_than_the_budget_is_polled_less_and_less(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, _ = pair  # the server never answers
    polls, socket_poll = BusyPoll(budget=20e-6), SocketPoll(ours.fileno())
    for _ in range(5_000):
        polls.wait(socket_poll)
    # Misses at commands 1, 3, 6, 11, ... (each doubling the commands skipped after
    # it), then one per MAX_SKIP + 1: 14 in 5,000, not 5,000.
    assert polls.misses == 14
    assert polls.spins == 0
    for _ in range(MAX_SKIP * 3):
        polls.wait(socket_poll)
    assert polls.misses == 17  # the skip stays at MAX_SKIP


def test_a_reply_within_the_budget_ends_the_backoff(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, server = pair
    polls, socket_poll = BusyPoll(budget=20e-6), SocketPoll(ours.fileno())
    for _ in range(100):  # several misses: the next spin is ~64 commands away
        polls.wait(socket_poll)
    server.send(b"+OK\r\n")  # the server is near again
    while polls.spins == 0:
        polls.wait(socket_poll)
    ours.recv(100)
    misses = polls.misses
    polls.wait(socket_poll)  # nothing there: a miss, after which one command skips
    polls.wait(socket_poll)
    polls.wait(socket_poll)
    assert polls.misses == misses + 2


async def test_replies_arrive_whole_and_in_order_with_polling_on(
    redis_url: str, prefix: str
) -> None:
    """A budget long enough for every reply to be polled for: values of every size (one
    larger than a socket read) reach the command that asked for them."""
    config = make_config(redis_url, prefix, NO_L1, redis={"busy_poll": "1ms"})
    async with LayeredCache.from_config(config) as cache:
        values = {i: "x" * (i * 997) for i in range(0, 200, 7)}
        for i, value in values.items():
            await cache.set("book", {"id": i}, value)
        for i, value in values.items():
            assert await cache.get("book", {"id": i}) == value
        polls = _polls(cache)
        assert polls.spins > 0  # a local Redis answers within 1 ms, at least sometimes


async def test_a_redis_behind_a_slow_link_is_polled_a_handful_of_times(
    redis_server: RedisServer, prefix: str
) -> None:
    """Every reply takes 2 ms (a proxy in this event loop, which a spin also holds up):
    each poll would burn its whole budget; after a few misses nearly none runs."""
    proxy = await ToxicProxy(redis_server.host, redis_server.port).start()
    proxy.mode, proxy.latency = "latency", 0.002
    config = make_config(proxy.url, prefix, NO_L1, redis={"busy_poll": "200us", "timeout": "1s"})
    try:
        async with LayeredCache.from_config(config) as cache:
            for i in range(300):
                await cache.set("book", {"id": i}, i)
            assert [await cache.get("book", {"id": i}) for i in range(300)] == list(range(300))
            assert _polls(cache).misses <= 12  # of 600+ commands
    finally:
        await proxy.stop()


async def test_a_burst_of_concurrent_commands_runs_its_work_instead_of_polling(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, redis=BURST)
    async with LayeredCache.from_config(config) as cache:
        polls = _polls(cache)
        before = polls.spins + polls.misses
        await asyncio.gather(*(cache.set("book", {"id": i}, i) for i in range(100)))
        # Only calls that find the loop with nothing else queued poll: the last ones.
        assert polls.spins + polls.misses - before < 20


async def test_busy_poll_0s_never_polls(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, NO_L1, redis={"busy_poll": "0s"})
    async with LayeredCache.from_config(config) as cache:
        assert cache._parts.store.direct is not None
        assert cache._parts.store.direct.busy_poll is None
        await cache.set("book", {"id": 1}, "v")
        assert await cache.get("book", {"id": 1}) == "v"


async def test_the_listener_connection_never_polls(redis_url: str) -> None:
    """Its XREAD BLOCK waits for entries for up to ``backplane.block``: a spin there
    would always burn its budget."""
    client = redis.Redis.from_url(redis_url)
    held = direct.HeldConnection(client)
    try:
        assert held._busy_poll is None
    finally:
        await client.aclose()


def test_busy_poll_is_written_in_microseconds_and_bounded() -> None:
    def config(value: object) -> float:
        raw = {"redis": {"busy_poll": value}, "namespaces": {"b": {"key": "b:{id}"}}}
        return parse_config(raw, source="<t>", env={}).redis.busy_poll

    assert config("50us") == pytest.approx(50e-6)
    assert config("0.5ms") == pytest.approx(500e-6)
    assert config("0s") == 0.0
    assert format_duration(50e-6) == "50us"
    with pytest.raises(ValueError, match=r"redis\.busy_poll: must be <= 1ms, got 2000us"):
        config("2ms")
    with pytest.raises(ValueError, match=r"redis\.busy_poll: must be <= timeout / 10 \(500us\)"):
        parse_config(
            {"redis": {"busy_poll": "1ms", "timeout": "5ms"}, "namespaces": {"b": {"key": "b:{id}"}}},
            source="<t>",
            env={},
        )
    env = {"LAYERED_CACHE_REDIS_BUSY_POLL": "0"}
    raw = {"namespaces": {"b": {"key": "b:{id}"}}}
    assert parse_config(raw, source="<t>", env=env).redis.busy_poll == 0.0


def test_under_uvloop_sequential_commands_poll_and_a_burst_does_not(
    redis_url: str, prefix: str
) -> None:
    """uvloop (uvicorn's default loop) doesn't show its ready queue: there a command
    alone in flight polls, and in a burst only a command that finds itself alone does."""

    async def scenario() -> tuple[int, int]:
        config = make_config(redis_url, prefix, NO_L1, redis=BURST)
        async with LayeredCache.from_config(config) as cache:
            polls = _polls(cache)
            for i in range(50):
                await cache.set("book", {"id": i}, i)
                assert await cache.get("book", {"id": i}) == i
            alone = polls.spins
            before = polls.spins + polls.misses
            await asyncio.gather(*(cache.set("book", {"id": i}, -i) for i in range(100)))
            assert await cache.get_many("book", [{"id": i} for i in range(100)]) == [
                -i for i in range(100)
            ]
            return alone, polls.spins + polls.misses - before

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        alone, in_burst = runner.run(scenario())
    assert alone > 0
    assert in_burst < 20
