"""What a client of a relay's port may send, and what it gets: no forged entry (a field
`ORIGIN` cleared every L1), let go when it leaves with a command unread, COUNT and IDs
read as Redis reads them, and catch-up reads that don't open a Redis connection each.
From an adversarial review of the relay (2026-12-05); each test failed before."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import pytest
import redis.asyncio as redis
from redis.exceptions import ResponseError

from layered_cache import LayeredCache
from layered_cache._relay import Relay
from layered_cache._relay_upstream import Upstream
from tests.helpers import eventually, in_l1, make_config, start_relay
from tests.servers import RedisServer

pytestmark = pytest.mark.timeout(60)

BLOCK = "200ms"


async def _value(value: str) -> str:
    return value


def _stream(config: Any) -> str:
    return str(config.redis.prefix + config.backplane.stream)


async def test_a_client_of_the_relay_port_cannot_forge_an_entry_that_clears_every_l1(
    redis_server: RedisServer, prefix: str
) -> None:
    """_relay_commands.refused_forward: "a relay port must not let a client trim the
    stream with MAXLEN 0, move its IDs ahead, or forge entries"; docs/operations.md: the
    relay forwards only the start marker `XADD <stream> * origin <id>`, which "names
    nothing". The field name is compared upper-cased, so `XADD <stream> * ORIGIN x` is
    forwarded: an entry whose field is not `origin`, which every listener of the fleet
    (behind any relay, or direct) reads as undecodable (`backplane_bad_entry`) and
    answers by clearing its whole L1. One command from anyone on the relay's port,
    repeatable at will, empties every instance's L1."""
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = _stream(base)
    relay, relay_url = await start_relay(base)
    behind = make_config(redis_server.url, prefix, backplane={"block": BLOCK, "relay": relay_url})
    through = redis.Redis.from_url(relay_url, protocol=2)
    try:
        async with (
            LayeredCache.from_config(base) as direct_reader,
            LayeredCache.from_config(behind) as relayed_reader,
        ):
            readers = (direct_reader, relayed_reader)
            for reader in readers:
                assert await eventually(lambda r=reader: r.backplane_status().connected)
                await reader.get_or_load("book", {"id": 1}, lambda: _value("v1"))
                assert in_l1(reader, 1)
            with contextlib.suppress(ResponseError):  # refusing it would do
                await through.execute_command("XADD", stream, "*", "ORIGIN", "forged")
            await asyncio.sleep(1.0)  # several reads (block 200 ms)
            for reader in readers:
                status = reader.backplane_status()
                assert status is not None and status.gaps == 0, status
                assert in_l1(reader, 1)
    finally:
        await through.aclose()
        await relay.close()


async def test_a_client_that_sent_another_command_and_left_during_a_blocking_read_is_let_go(
    redis_url: str, prefix: str
) -> None:
    """docs/operations.md: "one that disconnects during a blocking read is let go within
    a second" (Redis frees it at once). The relay checks ``StreamReader.at_eof()``, which
    stays False while the reader still buffers unread bytes: a client that pipelined one
    more command (a PING) behind its `XREAD BLOCK 0` and then disconnected is held,
    connection, task and all, until the next entry arrives (on an idle stream: for ever;
    the relay's BLOCK 0 gives up after 1e9 ms, 11.6 days)."""
    config = make_config(redis_url, prefix, backplane={"block": BLOCK})
    stream = _stream(config)
    direct = redis.Redis.from_url(redis_url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    await direct.aclose()
    relay = Relay(Upstream(config.redis, stream, 0.2), stream, clock=time.time, block=0.2)
    host, port = await relay.start("127.0.0.1", 0)
    try:
        assert await eventually(lambda: relay.status().following)
        raw = socket.create_connection((host, port))
        block = "*6\r\n$5\r\nXREAD\r\n$5\r\nBLOCK\r\n$1\r\n0\r\n$7\r\nSTREAMS\r\n"
        raw.send(f"{block}${len(stream)}\r\n{stream}\r\n$1\r\n$\r\n".encode())
        assert await eventually(lambda: relay.status().clients == 1)
        await asyncio.sleep(0.3)  # the XREAD is parsed and blocking
        raw.send(b"*1\r\n$4\r\nPING\r\n")  # pipelined behind it
        await asyncio.sleep(0.1)
        raw.close()
        assert await eventually(lambda: relay.status().clients == 0, timeout=3), (
            "the relay still holds a client that left during its blocking read"
        )
    finally:
        await relay.close()


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(("COUNT", "0"), id="count-0-means-no-limit"),
        pytest.param(("COUNT", "-1"), id="negative-count-means-no-limit"),
        pytest.param(("COUNT", "+3"), id="count-with-plus-sign"),
        pytest.param(("COUNT", "1_0"), id="count-with-underscore"),
    ],
)
async def test_xread_options_get_the_answer_redis_gives(
    redis_url: str, prefix: str, arguments: tuple[str, ...]
) -> None:
    """README: "the relay answers every read as Redis would" (docs/operations.md: "the
    relay answers 'the entries after ID X' exactly as Redis would, or closes the
    connection"). Redis reads COUNT <= 0 as no limit and refuses "+3" or "1_0" ("value
    is not an integer"); the relay (``_relay_commands.xread_arguments``: ``int()`` and
    ``value > 0``) answers the first with an error and the others with entries."""
    await _compare(redis_url, prefix, ("XREAD", *arguments, "STREAMS"), None)


@pytest.mark.parametrize(
    "position",
    [
        pytest.param(b"1-", id="no-sequence-after-dash"),
        pytest.param(b"1_0", id="underscore"),
        pytest.param("\u0663".encode(), id="arabic-indic-digit"),
        pytest.param(b"99999999999999999999-0", id="millis-over-64-bits"),
    ],
)
async def test_a_malformed_id_gets_the_error_redis_gives(
    redis_url: str, prefix: str, position: bytes
) -> None:
    """Same promise. Redis answers "ERR Invalid stream ID" for each of these; the relay
    (``_stream.parse_id``: ``str.partition`` and Python's ``int``, which takes "",
    "1_0", non-ASCII digits and any size) reads them as positions and answers with
    entries, or with nil (or blocks) for an ID past 2^64 that no stream can reach."""
    await _compare(redis_url, prefix, ("XREAD", "STREAMS"), position)


async def _compare(
    redis_url: str, prefix: str, head: tuple[str, ...], position: bytes | None
) -> None:
    config = make_config(redis_url, prefix, backplane={"block": BLOCK})
    stream = _stream(config)
    direct = redis.Redis.from_url(redis_url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay, relay_url = await start_relay(config)
    through = redis.Redis.from_url(relay_url, protocol=2)
    try:
        ids = [await direct.xadd(stream, {"keys": f"k{i}"}) for i in range(5)]
        assert await eventually(lambda: relay.status().last_id == ids[-1].decode())
        command = (*head, stream, position if position is not None else b"0-0")
        answers = []
        for client in (direct, through):
            try:
                answers.append(("reply", await client.execute_command(*command)))
            except ResponseError as exc:
                answers.append(("error", type(exc).__name__))
        expected, got = answers
        assert got[0] == expected[0] and (got[0] == "error" or got == expected), (
            f"{command!r}: Redis {expected!r}, relay {got!r}"
        )
    finally:
        await through.aclose()
        await relay.close()
        await direct.aclose()


async def test_catch_up_reads_through_a_relay_do_not_open_a_redis_connection_per_instance(
    redis_server: RedisServer, prefix: str
) -> None:
    """docs/operations.md, "Fan-out": "Redis then sees one reader per relay, whatever the
    number of instances behind it". Reads older than the relay's memory (every instance
    catching up after a relay restart, or any client of its port asking from 0-0) are
    forwarded on ``Upstream``'s redis-py client, whose pool is unbounded: 40 concurrent
    catch-up reads leave ~40 connections from the one relay open on the master, idle,
    for as long as the relay runs. A fleet of relays whose instances all catch up at
    once (after a failover every relay resets) multiplies that towards Redis's
    ``maxclients``; any process on a relay's port can do it at will."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = _stream(config)
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    for i in range(20):
        await direct.xadd(stream, {"keys": f"k{i}"})
    relay, relay_url = await start_relay(config, keep=5)  # starts after them: 0-0 is older
    clients = [redis.Redis.from_url(relay_url, protocol=2) for _ in range(40)]
    try:
        baseline = int((await direct.info("clients"))["connected_clients"])
        replies = await asyncio.gather(*(c.xread({stream: "0-0"}, count=5) for c in clients))
        assert all(len(reply[0][1]) == 5 for reply in replies)  # forwarded, answered
        await asyncio.sleep(0.5)
        held = int((await direct.info("clients"))["connected_clients"]) - baseline
        assert held <= 2, f"the relay holds {held} more connections to Redis after 40 reads"
    finally:
        for client in clients:
            await client.aclose()
        await relay.close()
        await direct.aclose()


@pytest.mark.parametrize(
    ("head", "position"),
    [
        pytest.param(("XREAD", "COUNT", "007", "STREAMS"), None, id="count-with-leading-zeros"),
        pytest.param(("XREAD", "COUNT", "-0", "STREAMS"), None, id="count-minus-zero"),
        pytest.param(("XREAD", "STREAMS"), b"+3", id="id-with-plus-sign"),
    ],
)
async def test_the_relay_reads_xread_arguments_as_redis_does(
    redis_url: str, prefix: str, head: tuple[str, ...], position: bytes | None
) -> None:
    """d13c1ab, docs/operations.md: "XREAD's COUNT and IDs are read as Redis reads them
    (... +3 ... are errors)". Redis's COUNT goes through ``string2ll``, which refuses
    leading zeros and "-0" ("value is not an integer"); the relay's ``_INTEGER``
    (``-?[0-9]+``) takes them. Redis's IDs go through ``string2ull`` -> ``strtoull``,
    which takes "+3"; the relay's ``_STREAM_ID`` refuses it. (Low severity: no library
    client sends these; the documented parity is what fails.)"""
    await _compare(redis_url, prefix, head, position)


async def test_a_relay_answers_time_with_redis_clock(redis_server: RedisServer, prefix: str) -> None:
    """A relay below another measures Redis's time through it (``Upstream.time``): its
    position in the stream is judged against Redis's clock, not its host's."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    relay, relay_url = await start_relay(config)
    below = Upstream(config.redis, _stream(config), 0.2, url=relay_url)
    direct = redis.Redis.from_url(redis_server.url)
    try:
        before = time.time()
        through = await below.time()
        seconds, micros = await direct.time()
        assert before - 1 < through <= seconds + micros / 1e6
    finally:
        await below.reset()
        await direct.aclose()
        await relay.close()
