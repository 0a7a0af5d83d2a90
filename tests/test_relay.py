"""The backplane relay (``layered-cache relay``): instances read the stream through it, and
every backplane guarantee still holds - delivery, catch-up after a disconnect (of the
instance, of the relay, of the relay from Redis), "a gap clears L1" - while Redis
answers one reader per relay instead of one per instance."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis

from layered_cache import ConfigError, LayeredCache
from layered_cache._config import Config
from layered_cache._relay import Relay, _Unavailable
from layered_cache._relay_upstream import Upstream
from layered_cache._resp import parse_command
from tests.faults.proxy import ToxicProxy
from tests.helpers import CountingLoader, eventually, in_l1, make_config, start_relay
from tests.servers import RedisServer, free_port

BLOCK = "200ms"


def stream_of(config: Config) -> str:
    return config.redis.prefix + config.backplane.stream


@contextlib.asynccontextmanager
async def running_relay(
    config: Config, *, port: int = 0, keep: int = 10_000, upstream: str | None = None
) -> AsyncIterator[tuple[Relay, str]]:
    relay, url = await start_relay(config, port, upstream=upstream, keep=keep)
    try:
        yield relay, url
    finally:
        await relay.close()


def relayed(url: str, prefix: str, relay_url: str, **redis_section: Any) -> Config:
    return make_config(
        url, prefix, backplane={"block": BLOCK, "relay": relay_url}, redis=redis_section
    )


@contextlib.asynccontextmanager
async def instances(config: Config, count: int) -> AsyncIterator[list[LayeredCache]]:
    caches = [LayeredCache.from_config(config) for _ in range(count)]
    try:
        for cache in caches:
            await cache.start()
        yield caches
    finally:
        for cache in caches:
            await cache.close()


async def version(value: str) -> str:
    return value


async def l1_holds(cache: LayeredCache, book: int) -> bool:
    """Whether ``cache`` serves book ``book`` from its L1 (a read that would otherwise
    count as an L2 hit or a load)."""
    before = cache.stats()["book"]["l1_hit"]
    await cache.get_or_load("book", {"id": book}, lambda: version("reloaded"))
    return cache.stats()["book"]["l1_hit"] == before + 1  # type: ignore[operator]


async def xread_calls(server: RedisServer) -> int:
    client = redis.Redis.from_url(server.url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


async def test_20_instances_behind_a_relay_cost_redis_one_reader_and_all_hear_an_invalidation(
    redis_server: RedisServer, prefix: str
) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    async with (
        running_relay(base) as (relay, relay_url),
        instances(relayed(redis_server.url, prefix, relay_url), 20) as caches,
    ):
        for cache in caches:
            assert await cache.get_or_load("book", {"id": 1}, lambda: version("v1")) == "v1"
        before = await xread_calls(redis_server)
        await asyncio.sleep(2.0)  # idle: every instance blocks on the relay, not on Redis
        idle_reads = await xread_calls(redis_server) - before
        await caches[0].invalidate("book", {"id": 1})
        for cache in caches[1:]:
            assert await eventually(lambda c=cache: c.stats()["book"]["backplane_l1_dropped"] == 1)
            assert await cache.get_or_load("book", {"id": 1}, lambda: version("v2")) == "v2"
        assert relay.status().replies_from_memory >= 19
    # The relay's own XREAD (block 200 ms) is the only one: 20 instances reading Redis
    # directly would be about 200 in 2 s.
    assert idle_reads <= 15


async def test_the_relay_answers_every_read_as_redis_would(
    redis_server: RedisServer, prefix: str
) -> None:
    """From memory, past its memory (keep=5: older positions go to Redis), with COUNT,
    from 0-0, from between two entries and from beyond the newest."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = stream_of(config)
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    try:
        await direct.xadd(stream, {"origin": "-"})
        async with running_relay(config, keep=5) as (relay, relay_url):
            ids = [await direct.xadd(stream, {"keys": f"k{i}"}) for i in range(40)]
            assert await eventually(lambda: relay.status().last_id == ids[-1].decode())
            through = redis.Redis.from_url(relay_url, protocol=2)
            try:
                millis = int(ids[20].split(b"-")[0])
                positions = [b"0-0", *ids, b"%d-%d" % (millis, 2**40), b"%d-0" % (millis + 10**9)]
                for position in positions:
                    for count in (None, 1, 3, 1000):
                        expected = await direct.xread({stream: position}, count=count)
                        got = await through.xread({stream: position}, count=count)
                        assert got == expected, (position, count)
            finally:
                await through.aclose()
            assert relay.status().forwarded > 0  # the old positions went to Redis
            assert relay.status().replies_from_memory > 0
    finally:
        await direct.aclose()


def disconnected(cache: LayeredCache) -> bool:
    status = cache.backplane_status()
    return status is not None and not status.connected


async def test_an_instance_catches_up_through_a_restarted_relay_without_clearing_l1(
    redis_server: RedisServer, prefix: str
) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    relay, relay_url = await start_relay(base)
    port = int(relay_url.rsplit(":", 1)[1])
    async with (
        LayeredCache.from_config(base) as writer,  # reads the stream directly
        instances(relayed(redis_server.url, prefix, relay_url), 1) as [reader],
    ):
        for book in (1, 2):
            await reader.get_or_load("book", {"id": book}, lambda: version("v1"))
        await relay.close()  # the reader is cut off while the writer invalidates
        assert await eventually(lambda: disconnected(reader))
        await writer.invalidate("book", {"id": 1})
        relay, _ = await start_relay(base, port)
        try:
            assert await eventually(lambda: reader.stats()["book"]["backplane_l1_dropped"] == 1)
            assert await reader.get_or_load("book", {"id": 1}, lambda: version("v2")) == "v2"
            assert await l1_holds(reader, 2)  # caught up: nothing else was dropped
            status = reader.backplane_status()
            assert status is not None and status.gaps == 0
        finally:
            await relay.close()


async def test_a_position_trimmed_while_the_relay_was_away_clears_l1(
    redis_server: RedisServer, prefix: str
) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = stream_of(base)
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    relay, relay_url = await start_relay(base)
    port = int(relay_url.rsplit(":", 1)[1])
    async with instances(relayed(redis_server.url, prefix, relay_url), 1) as [reader]:
        await reader.get_or_load("book", {"id": 2}, lambda: version("v1"))
        await relay.close()
        assert await eventually(lambda: disconnected(reader))
        await direct.xadd(stream, {"keys": "x"})  # entries the reader never saw...
        await direct.xtrim(stream, maxlen=0)  # ...trimmed away
        relay, _ = await start_relay(base, port)
        try:
            assert await eventually(lambda: reader.backplane_status().gaps == 1)  # type: ignore[union-attr]
            assert not await l1_holds(reader, 2)
        finally:
            await relay.close()
    await direct.aclose()


async def test_the_relay_losing_redis_loses_no_invalidation(
    redis_server: RedisServer, prefix: str
) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    admin = redis.Redis.from_url(redis_server.url)
    async with (
        running_relay(base) as (relay, relay_url),
        LayeredCache.from_config(base) as writer,
        instances(relayed(redis_server.url, prefix, relay_url), 3) as readers,
    ):
        for round_ in range(3):
            for reader in readers:
                await reader.get_or_load("book", {"id": round_}, lambda: version("v1"))
            # Kill the relay's upstream connection (the only XREAD client on Redis)
            # and invalidate at once, while the relay reconnects.
            clients = await admin.client_list()
            relay_connections = [c["id"] for c in clients if c["cmd"] == "xread"]
            assert relay_connections
            for client_id in relay_connections:
                await admin.client_kill_filter(_id=client_id)
            await writer.invalidate("book", {"id": round_})
            for reader in readers:
                assert await eventually(
                    lambda r=reader, n=round_: r.stats()["book"]["backplane_l1_dropped"] == n + 1
                )
        assert relay.status().resets >= 1
        for reader in readers:
            assert reader.backplane_status().gaps == 0  # type: ignore[union-attr]
    await admin.aclose()


async def test_a_relay_can_follow_another_relay(redis_server: RedisServer, prefix: str) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    async with (
        running_relay(base) as (_, first),
        running_relay(base, upstream=first) as (second_relay, second),
        LayeredCache.from_config(base) as writer,
        instances(relayed(redis_server.url, prefix, second), 2) as readers,
    ):
        for reader in readers:
            await reader.get_or_load("book", {"id": 1}, lambda: version("v1"))
        await writer.invalidate("book", {"id": 1})
        for reader in readers:
            assert await eventually(lambda r=reader: r.stats()["book"]["backplane_l1_dropped"] == 1)
        assert second_relay.status().replies_from_memory > 0


async def test_garbage_on_one_connection_leaves_the_relay_serving_the_others(
    redis_server: RedisServer, prefix: str
) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    async with (
        running_relay(base) as (relay, relay_url),
        LayeredCache.from_config(base) as writer,
        instances(relayed(redis_server.url, prefix, relay_url), 1) as [reader],
    ):
        port = int(relay_url.rsplit(":", 1)[1])
        replies = []
        for garbage in (
            b"hello\r\n",  # an inline command
            b"*1\r\n$999999999\r\n",  # a huge argument announced
            b"*100000\r\n",  # too many arguments
            b"*1\r\n$3\r\nGETxx",  # no CRLF after the bulk string
            b"\x00\xff" * 40000 + b"\r\n",  # one line longer than the read limit
        ):
            opened, sent = await asyncio.open_connection("127.0.0.1", port)
            sent.write(garbage)
            await sent.drain()
            replies.append(await asyncio.wait_for(opened.read(), 5))  # then closed
            sent.close()
        assert all(reply.startswith(b"-ERR protocol error") for reply in replies), replies
        through = redis.Redis.from_url(relay_url, protocol=2)
        for bad_command in (("GET", "x"), ("XREAD", "STREAMS", "other", "0-0"),
                            ("XREAD", "COUNT", "x", "STREAMS", stream_of(base), "0-0"),
                            ("XREAD", "STREAMS", stream_of(base), "not-an-id"),
                            ("XADD", "other-stream", "*", "a", "b")):  # fmt: skip
            with pytest.raises(redis.ResponseError):
                await through.execute_command(*bad_command)
        assert await through.ping()
        await through.aclose()
        await reader.get_or_load("book", {"id": 1}, lambda: version("v1"))
        await writer.invalidate("book", {"id": 1})
        assert await eventually(lambda: reader.stats()["book"]["backplane_l1_dropped"] == 1)
        assert relay.status().following and relay.status().resets == 0


async def test_instances_on_a_cluster_read_through_a_relay(redis_cluster: Any, prefix: str) -> None:
    cluster = {"cluster": True, "timeout": "1s"}
    base = make_config(redis_cluster.url, prefix, backplane={"block": BLOCK}, redis=cluster)
    async with (
        running_relay(base) as (_, relay_url),
        LayeredCache.from_config(base) as writer,
        instances(relayed(redis_cluster.url, prefix, relay_url, **cluster), 2) as readers,
    ):
        for reader in readers:
            await reader.get_or_load("book", {"id": 7}, lambda: version("v1"))
        await writer.invalidate("book", {"id": 7})
        for reader in readers:
            assert await eventually(lambda r=reader: r.stats()["book"]["backplane_l1_dropped"] == 1)


def test_a_relay_url_that_is_not_redis_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"backplane\.relay"):
        make_config("redis://127.0.0.1:1/0", "p:", backplane={"relay": "rediss://relay:6390"})


async def test_the_relay_command_serves_until_sigterm(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    path = tmp_path / "app.toml"
    path.write_text(
        f'[redis]\nurl = "{redis_server.url}"\nprefix = "{prefix}"\n\n'
        '[backplane]\nblock = "200ms"\n\n[namespaces.book]\nkey = "book:{id}"\n'
    )
    command = [sys.executable, "-m", "layered_cache", "relay", "--config", str(path),
               "--listen", "127.0.0.1:0"]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert line.startswith("relay listening on 127.0.0.1:"), line
        relay_url = "redis://" + line.split()[3].rstrip(",")
        base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
        async with (
            LayeredCache.from_config(base) as writer,
            instances(relayed(redis_server.url, prefix, relay_url), 1) as [reader],
        ):
            await reader.get_or_load("book", {"id": 1}, lambda: version("v1"))
            await writer.invalidate("book", {"id": 1})
            assert await eventually(lambda: reader.stats()["book"]["backplane_l1_dropped"] == 1)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_relay_whose_redis_refuses_its_password_logs_why(tmp_path: Path) -> None:
    """A relay rolled out with a wrong password followed nothing and said only
    ``relay_status following=False`` at info level, while its tcpSocket probes passed
    and every instance behind it was deaf."""
    with RedisServer(password="the-right-password") as server:
        wrong = server.url.replace("the-right-password", "a-stale-password")
        path = tmp_path / "app.toml"
        path.write_text(f'[redis]\nurl = "{wrong}"\n\n[namespaces.book]\nkey = "book:{{id}}"\n')
        command = [sys.executable, "-m", "layered_cache", "relay", "--config", str(path),
                   "--listen", "127.0.0.1:0", "--status-every", "0.5"]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert process.stderr is not None
        lines: list[str] = []
        try:
            with contextlib.suppress(TimeoutError):  # no warning in 10 s: asserted below
                async with asyncio.timeout(10):
                    while not any("relay_upstream_unreachable" in line for line in lines):
                        if not (line := await process.stderr.readline()):
                            break  # it exited
                        lines.append(line.decode())
            await asyncio.sleep(3)  # many more attempts: no more warnings (rate-limited)
        finally:
            process.send_signal(signal.SIGTERM)
            _, rest = await asyncio.wait_for(process.communicate(), 15)
        text = "".join(lines) + rest.decode()
        warnings = [line for line in text.splitlines() if "relay_upstream_unreachable" in line]
        assert len(warnings) == 1 and "AuthenticationError" in warnings[0], text
        assert "following=False" in text and "a-stale-password" not in text, text


async def _healthcheck(url: str) -> int:
    script = Path(__file__).parent.parent / "deploy" / "healthcheck.py"
    process = await asyncio.create_subprocess_exec(sys.executable, str(script), url)
    return await asyncio.wait_for(process.wait(), 10)


async def test_a_relay_is_ready_only_while_it_follows_its_stream(
    redis_server: RedisServer, prefix: str
) -> None:
    """deploy/k8s/relay.yaml's readiness probe (deploy/healthcheck.py): a TCP probe
    passed for a relay that followed nothing, so a bad Secret rolled out silently."""
    async with running_relay(make_config(redis_server.url, prefix)) as (_, url):
        assert await _healthcheck(url) == 0
    dead = make_config(f"redis://127.0.0.1:{free_port()}/0", prefix)
    stream = stream_of(dead)
    relay = Relay(Upstream(dead.redis, stream, 0.2), stream, clock=time.time, block=0.2)
    host, port = await relay.start("127.0.0.1", 0)
    try:
        await asyncio.sleep(0.5)
        assert not relay.status().following
        assert await _healthcheck(f"redis://{host}:{port}") == 1
    finally:
        await relay.close()


async def test_the_relay_command_on_a_taken_port_exits_2_with_one_line(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    path = tmp_path / "app.toml"
    path.write_text(f'[redis]\nurl = "{redis_server.url}"\nprefix = "{prefix}"\n')
    taken = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = taken.sockets[0].getsockname()[1]
    command = [sys.executable, "-m", "layered_cache", "relay", "--config", str(path),
               "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    try:
        process = await asyncio.create_subprocess_exec(*command, stderr=subprocess.PIPE)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    finally:
        taken.close()
    assert process.returncode == 2
    lines = stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layered-cache: error: cannot listen"), lines


async def test_a_relay_that_fell_behind_the_trimming_makes_its_instances_clear_l1(
    redis_server: RedisServer, prefix: str
) -> None:
    """The relay reads 2 entries at a time, slowly, while entries keep coming to a stream
    trimmed to 5: after a full batch it checks, as a listener does, finds entries it
    never read gone, and must not serve what follows as if nothing was missing; its
    instances check for themselves and clear their L1."""
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = stream_of(base)
    direct = redis.Redis.from_url(redis_server.url)
    await direct.xadd(stream, {"origin": "-"})
    upstream = Upstream(base.redis, stream, base.backplane.block)
    execute = upstream.execute
    slow = asyncio.Event()

    async def slow_reads(*args: Any) -> Any:
        """A relay slow to take each batch in (a starved process, a slow network)."""
        reply = await execute(*args)
        if args[0] == "XREAD" and slow.is_set():
            await asyncio.sleep(0.3)
        return reply

    upstream.execute = slow_reads  # type: ignore[method-assign]
    relay = Relay(upstream, stream, clock=time.time, block=0.2, batch=2)
    host, port = await relay.start()
    try:
        assert await eventually(lambda: relay.status().following)
        config = relayed(redis_server.url, prefix, f"redis://{host}:{port}")
        async with instances(config, 1) as [reader]:
            await reader.get_or_load("book", {"id": 2}, lambda: version("v1"))
            slow.set()
            for i in range(40):  # 2 s of 20 entries a second: the relay reads ~7/s
                await direct.xadd(stream, {"keys": f"x{i}"}, maxlen=5, approximate=False)
                await asyncio.sleep(0.05)
            assert await eventually(lambda: reader.backplane_status().gaps >= 1)  # type: ignore[union-attr]
            assert relay.status().resets >= 1
            assert not await l1_holds(reader, 2)
    finally:
        await relay.close()
        await direct.aclose()


async def test_a_relay_that_stalled_while_the_stream_was_trimmed_past_it_resets(
    redis_server: RedisServer, prefix: str
) -> None:
    """The relay stands still (a starved process) while a writer invalidates book 2 and
    then enough other keys that ``MAXLEN ~ 5`` trims book 2's entry away. Its next read
    brings fewer than a full batch: a check on full batches only would serve what is
    left as if nothing was missing, and the instance behind it would keep book 2's stale
    copy. The relay checks after any read as long as a trim leaves, resets, and the
    instance, reconnecting, finds the gap itself and clears its L1."""
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK, "maxlen": 5})
    stream = stream_of(base)
    upstream = Upstream(base.redis, stream, base.backplane.block)
    execute, moving = upstream.execute, asyncio.Event()
    moving.set()

    async def stalling(*args: Any) -> Any:
        if args[0] == "XREAD":
            await moving.wait()
        return await execute(*args)

    upstream.execute = stalling  # type: ignore[method-assign]
    relay = Relay(upstream, stream, clock=time.time, block=0.2, maxlen=base.backplane.maxlen)
    host, port = await relay.start()
    try:
        assert await eventually(lambda: relay.status().following)
        config = relayed(redis_server.url, prefix, f"redis://{host}:{port}")
        async with instances(config, 1) as [reader], LayeredCache.from_config(base) as writer:
            await reader.get_or_load("book", {"id": 2}, lambda: version("v1"))
            moving.clear()
            await asyncio.sleep(0.5)  # the relay's blocked XREAD ends; the next one waits
            await writer.invalidate("book", {"id": 2})
            for book in range(1000, 1300):
                await writer.invalidate("book", {"id": book})
            assert await direct_length(redis_server.url, stream) < 300
            moving.set()
            assert await eventually(lambda: relay.status().resets >= 1)
            assert await eventually(lambda: reader.backplane_status().gaps >= 1)  # type: ignore[union-attr]
            assert not await l1_holds(reader, 2)
    finally:
        await relay.close()


async def direct_length(url: str, stream: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(await client.xlen(stream))
    finally:
        await client.aclose()


def test_a_command_split_anywhere_parses_the_same() -> None:
    """However TCP cuts a command (every split point, and two commands in one read)."""
    command = [b"XREAD", b"COUNT", b"1000", b"BLOCK", b"1000", b"STREAMS", b"s", b"0-0"]
    wire = b"*%d\r\n" % len(command) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in command)
    for cut in range(len(wire)):
        assert parse_command(wire[:cut]) is None
    assert parse_command(wire) == (command, len(wire))
    assert parse_command(wire + wire) == (command, len(wire))


async def test_a_client_sending_one_byte_at_a_time_is_served(
    redis_server: RedisServer, prefix: str
) -> None:
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = stream_of(base).encode()
    async with running_relay(base) as (_, relay_url):
        port = int(relay_url.rsplit(":", 1)[1])
        replies, sent = await asyncio.open_connection("127.0.0.1", port)
        command = [b"XREAD", b"BLOCK", b"10", b"STREAMS", stream, b"$"]
        wire = b"*6\r\n" + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in command)
        for byte in wire:
            sent.write(bytes([byte]))
            await sent.drain()
            await asyncio.sleep(0)
        assert await asyncio.wait_for(replies.readline(), 5) == b"*-1\r\n"
        sent.close()


async def test_a_bug_in_the_relays_follower_resets_it_and_loses_no_invalidation(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower that died on a bug would leave its instances connected and told
    "nothing new" forever. It resets instead, as when it loses Redis."""
    base = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    async with (
        running_relay(base) as (relay, relay_url),
        LayeredCache.from_config(base) as writer,
        instances(relayed(redis_server.url, prefix, relay_url), 3) as readers,
    ):
        for reader in readers:
            await reader.get_or_load("book", {"id": 1}, lambda: version("v1"))
        read_once = relay._read_once
        failures = [RuntimeError("a bug in the relay")]

        async def buggy_read_once(tail: Any) -> bool:
            if failures:
                raise failures.pop()
            return await read_once(tail)

        monkeypatch.setattr(relay, "_read_once", buggy_read_once)
        assert await eventually(lambda: not failures)  # its next read (block: 200 ms)
        await writer.invalidate("book", {"id": 1})
        for reader in readers:
            assert await eventually(lambda r=reader: r.stats()["book"]["backplane_l1_dropped"] == 1)
        status = relay.status()
        assert (status.errors, status.following) == (1, True)
        assert status.resets >= 1

        # Following again: the next invalidation reaches every instance too.
        for reader in readers:
            await reader.get_or_load("book", {"id": 2}, lambda: version("v1"))
        await writer.invalidate("book", {"id": 2})
        for reader in readers:
            assert await eventually(lambda r=reader: r.stats()["book"]["backplane_l1_dropped"] == 2)
            assert reader.backplane_status().gaps == 0  # type: ignore[union-attr]


async def test_odd_reads_get_bounded_answers_and_the_relay_serves_on(
    redis_server: RedisServer, prefix: str
) -> None:
    """Without COUNT a reply holds at most the relay's batch (each was the whole memory,
    cached per position: 500 such reads held 250 times the entries); a BLOCK of 400
    digits or a command name that is not UTF-8 is an error reply, not a dropped client."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = stream_of(config)
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay = Relay(
        Upstream(config.redis, stream, 0.2), stream, clock=time.time, block=0.2, batch=5
    )
    host, port = await relay.start("127.0.0.1", 0)
    through = redis.Redis.from_url(f"redis://{host}:{port}/0", protocol=2)
    try:
        assert await eventually(lambda: relay.status().following)
        ids = [await direct.xadd(stream, {"keys": f"k{i}"}) for i in range(40)]
        assert await eventually(lambda: relay.status().last_id == ids[-1].decode())
        for position in ids[:30]:
            (reply,) = await through.xread({stream: position})
            assert 1 <= len(reply[1]) <= 5
        with pytest.raises(redis.ResponseError):
            await through.execute_command("XREAD", "BLOCK", "9" * 400, "STREAMS", stream, "$")
        with pytest.raises(redis.ResponseError):
            await through.execute_command(b"\xff\xfe", "x")
        assert await through.xread({stream: ids[-2]}) == await direct.xread({stream: ids[-2]})
    finally:
        await through.aclose()
        await relay.close()
        await direct.aclose()


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        (["--status-every", "0"], "--status-every"),
        (["--status-every", "nan"], "--status-every"),
        (["--upstream", "http://x"], "--upstream"),
    ],
)
def test_relay_arguments_it_cannot_run_with_exit_2_with_one_line(
    tmp_path: Path, argument: list[str], expected: str
) -> None:
    """--status-every 0 logged its status in a tight loop (26,768 lines in 3 s); an
    http:// upstream started, then logged a traceback per retry."""
    path = tmp_path / "app.toml"
    path.write_text('[redis]\nurl = "redis://127.0.0.1:1/0"\n')
    command = [sys.executable, "-m", "layered_cache", "relay", "--config", str(path), *argument]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines


async def test_a_client_that_never_reads_its_replies_is_dropped_and_the_relay_serves_on(
    redis_server: RedisServer, prefix: str
) -> None:
    """It sent reads and left the replies unread: the relay waited on its full buffer
    for as long as it ran, holding the connection and the bytes. Now it waits
    ``send_timeout`` and drops it; the other clients are served throughout."""
    config = make_config(redis_server.url, prefix, backplane={"block": BLOCK})
    stream = stream_of(config)
    direct = redis.Redis.from_url(redis_server.url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay = Relay(
        Upstream(config.redis, stream, 0.2), stream, clock=time.time, block=0.2, batch=1000,
        send_timeout=0.5,
    )
    host, port = await relay.start("127.0.0.1", 0)
    through = redis.Redis.from_url(f"redis://{host}:{port}/0", protocol=2)
    try:
        assert await eventually(lambda: relay.status().following)
        pipe = direct.pipeline(transaction=False)
        for i in range(1000):
            pipe.xadd(stream, {"keys": f"k{i}".ljust(2000, ".")})
        ids = await pipe.execute()
        assert await eventually(lambda: relay.status().last_id == ids[-1].decode())
        # ~2 MB per reply, 20 of them asked for and never read: more than the socket
        # buffers and the transport's high-water mark hold.
        command = "*6\r\n$5\r\nXREAD\r\n$5\r\nCOUNT\r\n$4\r\n1000\r\n$7\r\nSTREAMS\r\n"
        command += f"${len(stream)}\r\n{stream}\r\n$3\r\n0-0\r\n"
        assert await through.ping()  # connected: one client
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: binding
        raw.connect((host, port))
        raw.setblocking(False)
        _, sending = await asyncio.open_connection(sock=raw)
        sending.write(command.encode() * 20)
        await sending.drain()
        assert await eventually(lambda: relay.status().clients == 2, timeout=5)
        assert await through.xread({stream: ids[-2]}) == await direct.xread({stream: ids[-2]})
        assert await eventually(lambda: relay.status().clients == 1, timeout=5)  # dropped
        assert await through.xread({stream: ids[-2]}) == await direct.xread({stream: ids[-2]})
        sending.close()
    finally:
        await through.aclose()
        await relay.close()
        await direct.aclose()


async def _relay_with_entries(
    url: str, prefix: str, send_timeout: float, size: int
) -> tuple[Relay, str, int, str, list[asyncio.StreamWriter]]:
    """A relay holding 1,000 entries of ``size`` bytes; the writers of its clients are
    recorded (to see what the relay still holds for them)."""
    config = make_config(url, prefix, backplane={"block": BLOCK})
    stream = stream_of(config)
    direct = redis.Redis.from_url(url, protocol=2)
    await direct.xadd(stream, {"origin": "-"})
    relay = Relay(
        Upstream(config.redis, stream, 0.2),
        stream,
        clock=time.time,
        block=0.2,
        batch=1000,
        send_timeout=send_timeout,
    )
    writers: list[asyncio.StreamWriter] = []
    serve = relay._serve

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await serve(reader, writer)

    relay._serve = recording  # type: ignore[method-assign]
    host, port = await relay.start("127.0.0.1", 0)
    assert await eventually(lambda: relay.status().following)
    pipe = direct.pipeline(transaction=False)
    for i in range(1000):
        pipe.xadd(stream, {"keys": f"k{i}".ljust(size, ".")})
    ids = await pipe.execute()
    assert await eventually(lambda: relay.status().last_id == ids[-1].decode())
    await direct.aclose()
    return relay, host, port, stream, writers


def _read_all(stream: str) -> bytes:
    command = "*6\r\n$5\r\nXREAD\r\n$5\r\nCOUNT\r\n$4\r\n1000\r\n$7\r\nSTREAMS\r\n"
    return (command + f"${len(stream)}\r\n{stream}\r\n$3\r\n0-0\r\n").encode()


def _small_socket(host: str, port: int) -> socket.socket:
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: binding
    raw.connect((host, port))
    raw.setblocking(False)
    return raw


async def test_a_client_reading_a_large_reply_slowly_but_steadily_is_not_dropped(
    redis_url: str, prefix: str
) -> None:
    """Review 2026-12-04: the whole drain was bounded, so a 6 MB reply to a client
    reading ~100 KB/s was cut after send_timeout. It is bounded by progress now."""
    relay, host, port, stream, _ = await _relay_with_entries(redis_url, prefix, 1.0, 6000)
    raw = _small_socket(host, port)
    try:
        raw.send(_read_all(stream))
        assert await eventually(lambda: relay.status().clients == 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        while loop.time() - started < 3.5:  # three and a half send_timeouts
            await asyncio.sleep(1 / 16)
            with contextlib.suppress(BlockingIOError):
                raw.recv(8192)  # ~128 KB/s
            assert relay.status().clients == 1, "a steady reader was dropped"
    finally:
        raw.close()
        await relay.close()


async def test_a_dropped_client_releases_its_connection_and_unread_replies(
    redis_url: str, prefix: str
) -> None:
    """Review 2026-12-04: the drop was writer.close(), which waits for the buffer to
    flush: the socket and ~1.3 MB per client stayed for as long as the relay ran."""
    relay, host, port, stream, writers = await _relay_with_entries(redis_url, prefix, 0.5, 2000)
    sockets = [_small_socket(host, port) for _ in range(5)]
    try:
        for raw in sockets:
            raw.send(_read_all(stream) * 5)
        assert await eventually(lambda: len(writers) == 5, timeout=5)
        assert await eventually(lambda: relay.status().clients == 0, timeout=10)
        # abort() empties the buffer at once and closes the socket a loop turn later.
        assert await eventually(lambda: all(_released(w) for w in writers), timeout=5)
    finally:
        for raw in sockets:
            raw.close()
        await relay.close()


async def test_a_client_that_leaves_during_a_blocking_read_is_let_go(
    redis_url: str, prefix: str
) -> None:
    """Review 2026-12-04: a client that disconnected in a BLOCK 0 read on an idle stream
    stayed connected and counted until the next entry (Redis frees it at once)."""
    relay, host, port, stream, _ = await _relay_with_entries(redis_url, prefix, 0.5, 10)
    try:
        raw = socket.create_connection((host, port))
        block = "*6\r\n$5\r\nXREAD\r\n$5\r\nBLOCK\r\n$1\r\n0\r\n$7\r\nSTREAMS\r\n"
        raw.send(f"{block}${len(stream)}\r\n{stream}\r\n$1\r\n$\r\n".encode())
        assert await eventually(lambda: relay.status().clients == 1)
        raw.close()
        assert await eventually(lambda: relay.status().clients == 0, timeout=3)
    finally:
        await relay.close()


def _released(writer: asyncio.StreamWriter) -> bool:
    transport = writer.transport
    closed = transport.get_extra_info("socket").fileno() == -1
    return transport.is_closing() and transport.get_write_buffer_size() == 0 and closed


@pytest.mark.parametrize("listen", ["127.0.0.1:６３９０", "127.0.0.1:³", "127.0.0.1"])
def test_a_listen_address_without_an_ascii_port_is_a_usage_error(
    listen: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``isdigit`` took "³", then ``int`` raised: a traceback instead of the usage line."""
    from layered_cache.cli import main

    path = tmp_path / "app.toml"
    path.write_text('[namespaces.book]\nkey = "book:{id}"\n')
    assert main(["relay", "--config", str(path), "--listen", listen]) == 2
    assert "--listen must be HOST:PORT" in capsys.readouterr().err


async def test_an_instance_started_while_its_relay_is_down_clears_l1_once_it_has_a_position(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-05): "A new cache ... starts serving only once its backplane listener knows its
    place in the stream, so no invalidation slips between its first L1 fill and the
    listener" and "invalidations drop it within the backplane's latency".

    B reads the stream through ``backplane.relay``, which is down (restarting, its pod
    not ready yet) when B starts. ``startup.positioned`` gives up after
    2 x (connect_timeout + timeout) and B serves, L2 (direct Redis) working: its L1
    fills. A invalidates book 1. When the relay comes up, B's listener takes its first
    position with ``_tail_id`` = the stream's newest entry, i.e. *after* A's
    invalidation, which it never applies.
    Observed: B serves the old value from L1 (60 s TTL) after A's invalidate() returned
    and B's listener is connected. Expected: no old value once connected (position the
    listener before the first fill, e.g. from an ID of the start time, or clear L1 when
    the first position is taken after the cache began serving).
    Cause: BackplaneListener._run/_tail_id (last_id None -> newest) with
    _startup.positioned's timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backplane = {"block": "200ms"}
    a_config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}, backplane=backplane)
    b_config = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}},
        backplane={**backplane, "relay": f"redis://127.0.0.1:{port}"},
    )
    async with LayeredCache.from_config(a_config) as a:
        assert a._backplane is not None
        assert await eventually(a._backplane.connected.is_set)
        async with LayeredCache.from_config(b_config) as b:  # relay down: starts anyway
            assert b._backplane is not None and not b._backplane.connected.is_set()
            assert await b.get_or_load("book", {"id": 1}, CountingLoader("old")) == "old"
            assert in_l1(b, 1)
            await a.invalidate("book", {"id": 1})  # returned: L2 gone, entry appended
            relay, _url = await start_relay(a_config, port)
            try:
                assert await eventually(b._backplane.connected.is_set, timeout=10)
                await asyncio.sleep(1.0)
                value = await b.get("book", {"id": 1})
                assert value is None, (
                    f"B serves {value!r} from L1 after A's invalidate() returned and B's "
                    f"listener connected (gaps={b._backplane.gaps})"
                )
            finally:
                await relay.close()


async def test_an_instance_that_served_before_its_position_clears_l1_even_if_its_first_count_fails(
    redis_url: str, prefix: str
) -> None:
    """Was broken (a review, 2026-12-07): README, "if its listener (through a relay still
    starting, say) finds its place only after that, L1 is cleared then".

    As above, and right after answering B's XREVRANGE (its position) the relay can't
    answer the next command, the entry count's XINFO STREAM (its upstream blipped), and
    closes B's connection. The clear came after that XINFO in the same step: the next
    round kept the position, connected, and never cleared. Observed: B serves book 1's
    old value from L1 after A's invalidate() returned and B's listener connected.
    Expected: L1 cleared once B has a position. Cause: BackplaneListener._run acted on
    ``_serving_unpositioned`` after the count's first XINFO."""
    port = free_port()
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "60s"}}}
    a_config = make_config(redis_url, prefix, namespaces, backplane={"block": BLOCK})
    b_config = make_config(
        redis_url, prefix, namespaces,
        backplane={"block": BLOCK, "relay": f"redis://127.0.0.1:{port}"},
    )
    stream = stream_of(a_config)
    relay = Relay(Upstream(a_config.redis, stream, 0.2), stream, clock=time.time, block=0.2)
    forward, failed = relay._forward, []

    async def blip_at_first_xinfo(command: Any) -> bytes:
        if command[0].upper() == b"XINFO" and not failed:
            failed.append(command)
            raise _Unavailable  # the relay can't answer: it closes B's connection
        return await forward(command)

    relay._forward = blip_at_first_xinfo  # type: ignore[method-assign]
    async with LayeredCache.from_config(a_config) as a:
        assert a._backplane is not None
        assert await eventually(a._backplane.connected.is_set)
        async with LayeredCache.from_config(b_config) as b:  # relay down: starts anyway
            listener = b._backplane
            assert listener is not None and not listener.connected.is_set()
            assert await b.get_or_load("book", {"id": 1}, CountingLoader("old")) == "old"
            await a.invalidate("book", {"id": 1})  # returned: L2 gone, entry appended
            await relay.start("127.0.0.1", port)
            try:
                assert await eventually(listener.connected.is_set, timeout=10)
                assert failed
                await asyncio.sleep(1.0)
                value = await b.get("book", {"id": 1})
                assert value is None, (
                    f"B serves {value!r} from L1 after A's invalidate() returned and B's "
                    f"listener connected (gaps={listener.gaps})"
                )
            finally:
                await relay.close()


async def _accepts_on(port: int) -> bool:
    with contextlib.suppress(OSError):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        return True
    return False


async def test_a_relay_stopped_while_it_measures_redis_clock_exits_0(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """Found by a review of this session's fix (2026-12-06). docs/cli.md: the relay runs
    "until SIGTERM/SIGINT (exit 0)". Its signal handlers came only after its first
    samples of Redis's clock: a SIGTERM while an upstream that hangs kept it measuring
    killed it by the signal (-15), with no clean close."""
    proxy = await ToxicProxy("127.0.0.1", redis_server.port).start()
    proxy.mode = "blackhole"  # the upstream accepts and never answers (a hung Redis)
    path = tmp_path / "app.toml"
    path.write_text(
        f'[redis]\nurl = "{proxy.url}"\nprefix = "{prefix}"\n'
        'timeout = "10s"\nconnect_timeout = "10s"\n\n'
        '[backplane]\nblock = "200ms"\n\n[namespaces.book]\nkey = "book:{id}"\n'
    )
    port = free_port()
    command = [sys.executable, "-m", "layered_cache", "relay", "--config", str(path),
               "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        # Listening: now measuring Redis's clock.
        assert await eventually(lambda: _accepts_on(port), timeout=30)
        await asyncio.sleep(0.5)
        assert process.returncode is None
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 15)
        assert code == 0, f"the relay ended with {code} (killed by the signal), not exit 0"
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await proxy.stop()
