"""Scenario: what a round trip costs when the client sleeps for the reply.

What: one ``SET`` of ~1 KB on a plain socket (no client library, no event loop), one
request at a time, the reply awaited three ways: asleep in ``epoll`` (what an asyncio
client does when nothing else is ready), polling the socket with a zero timeout until
the reply is there, and polling for at most 100 µs then sleeping (``redis.busy_poll``'s
default, ``layered_cache._busypoll``). Wall and CPU time per round trip.

Why: it is the reason for ``redis.busy_poll``. If sleeping and polling cost about the
same wall time on a machine, the setting buys nothing there; on the bench VM the
sleeping round trip was more than twice as long, at the same CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import select
import socket
import time
import urllib.parse
from collections.abc import Callable

from bench.env import BenchEnv
from bench.floors import fmt_us, median
from bench.report import Headline, Section

VALUE = b"x" * 1000
BUDGET = 100e-6


def _command(key: bytes) -> bytes:
    parts = [b"SET", key, VALUE]
    return b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


def _ways(sock: socket.socket) -> dict[str, Callable[[], None]]:
    request = _command(b"bench:wakeup")
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)

    def asleep() -> None:
        sock.sendall(request)
        poller.poll()
        sock.recv(64)

    def polling() -> None:
        sock.sendall(request)
        while not poller.poll(0):
            pass
        sock.recv(64)

    def polling_then_asleep() -> None:
        sock.sendall(request)
        deadline = time.perf_counter() + BUDGET
        while not poller.poll(0):
            if time.perf_counter() >= deadline:
                poller.poll()
                break
        sock.recv(64)

    return {
        "asleep in epoll (an idle asyncio client)": asleep,
        "polling until the reply is there": polling,
        "polling up to 100 µs, then asleep (redis.busy_poll default)": polling_then_asleep,
    }


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("wakeup", "Round trip: asleep in epoll vs polling for the reply")
    url = urllib.parse.urlsplit(env.redis_url())
    n, repeats = (1_000, 3) if env.quick else (5_000, 7)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    try:
        ways = _ways(sock)
        for _ in range(repeats):  # interleaved: each repeat runs every way once
            for name, way in ways.items():
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(n):
                    way()
                walls.setdefault(name, []).append((time.perf_counter() - wall) / n)
                cpus.setdefault(name, []).append((time.process_time() - cpu) / n)
    finally:
        sock.close()
    section.columns = ["reply awaited", "wall per round trip", "CPU per round trip"]
    for name in walls:
        section.rows.append([name, fmt_us(median(walls[name])), fmt_us(median(cpus[name]))])
    section.notes.append(
        f"{repeats} repeats of {n:,} round trips each, interleaved; one connection; "
        "the Redis of the run, on the same host."
    )
    asleep, _, capped = list(walls)
    section.headline.append(
        Headline(
            "SET round trip, reply awaited asleep vs polling up to 100 µs",
            f"{fmt_us(median(walls[capped]))} polling (CPU {fmt_us(median(cpus[capped]))})",
            f"asleep in epoll {fmt_us(median(walls[asleep]))} "
            f"(CPU {fmt_us(median(cpus[asleep]))})",
            "reported",
            "info",
        )
    )
    section.data = {"wall_s": walls, "cpu_s": cpus, "n": n}
    section.seconds = time.perf_counter() - started
    return section
