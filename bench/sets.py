"""Scenario: writes. ``set()`` and ``set_many()`` against a raw redis-py floor.

What: sequential ``await cache.set("book", {"id": i}, value)`` against the floor
``await r.set(key, encode(value), px=ttl)`` (redis-py, msgspec encode of the same ~1 KB
value); ``set_many`` of 100 items against one non-transactional pipeline of the same 100
``SET PX``. Each floor is measured twice: with a default client, and with the cache's own
socket timeout (1 s: redis-py then wraps every read in ``asyncio.wait_for``).

Why: a ``set()`` also revokes the key's lease (a fill in flight must not land after it),
announces the key on the backplane (every other instance drops its L1 copy) and fills
this instance's L1; this measures what those guarantees cost on top of the write.

A reference row sends what set() asks of Redis by hand (the SET, the lease's DEL and the
backplane append in one EVALSHA of the library's one-key script, through redis-py): not
a target, it shows what the atomic write-and-announce costs without the library.

Beside the wall time per call, each batch's process CPU per call (``time.process_time``)
is reported as a ratio too: on a shared VM the wall ratio moves with the neighbours, the
CPU ratio much less. A second cache with the same config but its backplane listener
stopped (for comparison only: an instance must listen) shows what the writer's own
listener costs: it wakes for the writer's own entries (at most once per
``backplane.coalesce``) and parses them.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from redis.asyncio import Redis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import Batch, book_value, fmt_ratio, fmt_us, interleaved, median
from bench.raw_writes import raw_round_trips, summary
from bench.report import Headline, Section
from layered_cache import LayeredCache
from layered_cache._scripts import WRITE_ONE_SCRIPT

TARGET = 1.2
BATCH = 100  # items per set_many call
TTL_MS = 600_000
UNHEARD = ", own listener stopped"
UNPOLLED = ", busy_poll off"
SAME_WRITES = "reference: SET PX + DEL lease + XADD, one EVALSHA + encode (default client)"


#: CPU seconds per call of each contender's batches, in the order they ran.
CpuLog = dict[str, list[float]]


def _timed(name: str, body: Callable[[], Awaitable[object]], cpu: CpuLog) -> Batch:
    """A batch of ``body`` calls: wall seconds per call returned, CPU per call logged."""

    async def batch(n: int) -> float:
        cpu_start, start = time.process_time(), time.perf_counter()
        for _ in range(n):
            await body()
        wall = (time.perf_counter() - start) / n
        cpu.setdefault(name, []).append((time.process_time() - cpu_start) / n)
        return wall

    return batch


def _floors(client: Redis, prefix: str, value: Any, tag: str, cpu: CpuLog) -> dict[str, Batch]:
    encode = msgspec.msgpack.Encoder().encode
    counter = itertools.count()

    async def single() -> None:
        await client.set(f"{prefix}raw:{next(counter)}", encode(value), px=TTL_MS)

    async def pipelined() -> None:
        pipe = client.pipeline(transaction=False)
        for _ in range(BATCH):
            pipe.set(f"{prefix}raw:{next(counter)}", encode(value), px=TTL_MS)
        await pipe.execute()

    names = (f"floor: SET PX + encode ({tag})", f"floor: pipelined SET PX x{BATCH} + encode ({tag})")
    return {names[0]: _timed(names[0], single, cpu), names[1]: _timed(names[1], pipelined, cpu)}


def _same_writes(client: Redis, prefix: str, value: Any, cpu: CpuLog) -> dict[str, Batch]:
    """What set() asks of Redis, sent by hand: the key's SET, its lease's DEL and the
    backplane append as one EVALSHA of the library's own one-key script, through redis-py.
    Not a target: what a user who wrote the atomic write-and-announce themselves would
    pay, beside what the library's set() costs on top of a bare SET."""
    encode = msgspec.msgpack.Encoder().encode
    counter = itertools.count()
    script = client.register_script(WRITE_ONE_SCRIPT)
    stream = f"{prefix}same-writes-stream"

    async def single() -> None:
        key = f"{prefix}same:{next(counter)}"
        entry: list[bytes | str] = ["keys", encode([key]), "origin", "bench-origin"]
        await script(keys=[key, f"{key}:lease", stream], args=[encode(value), TTL_MS, 10_000, *entry])

    return {SAME_WRITES: _timed(SAME_WRITES, single, cpu)}


def _ours(cache: LayeredCache, value: Any, cpu: CpuLog, label: str = "") -> dict[str, Batch]:
    counter = itertools.count()

    async def single() -> None:
        await cache.set("book", {"id": next(counter)}, value)

    async def many() -> None:
        await cache.set_many("book", [({"id": next(counter)}, value) for _ in range(BATCH)])

    names = (f"layered_cache set(){label}", f"layered_cache set_many ({BATCH} items){label}")
    return {names[0]: _timed(names[0], single, cpu), names[1]: _timed(names[1], many, cpu)}


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("sets", "Writes: set() and set_many() vs raw SET PX (+ encode)")
    value = book_value()
    n, repeats = (300, 3) if env.quick else (2_000, 9)
    prefix = unique_prefix("sets")
    url = env.redis_url()
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "10m", "max_entries": 10_000}}}
    config = make_config(url, prefix, namespaces)
    deaf = make_config(url, f"{prefix}deaf:", namespaces)
    unpolled = make_config(url, f"{prefix}unpolled:", namespaces, busy_poll="0s")
    plain = Redis.from_url(url)
    timed = Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    cpu: CpuLog = {}
    try:
        async with (
            LayeredCache.from_config(config) as cache,
            LayeredCache.from_config(deaf) as quiet,
            LayeredCache.from_config(unpolled) as sleepy,
        ):
            await quiet._backplane.stop()  # type: ignore[union-attr]  # comparison only
            contenders = _floors(plain, prefix, value, "default client", cpu)
            contenders.update(_floors(timed, prefix, value, "1 s socket timeout", cpu))
            contenders.update(_same_writes(plain, prefix, value, cpu))
            contenders.update(_ours(cache, value, cpu))
            contenders.update(_ours(quiet, value, cpu, UNHEARD))
            contenders.update(_ours(sleepy, value, cpu, UNPOLLED))
            results = await interleaved(contenders, n, repeats)
        raw = await asyncio.to_thread(
            raw_round_trips, url, prefix, msgspec.msgpack.encode(value), n // 2, repeats
        )
    finally:
        await plain.aclose()
        await timed.aclose()
    medians = {name: median(values) for name, values in results.items()}
    # The calibration batches ran first: the last ``repeats`` are the measured ones.
    cpu_medians = {name: median(values[-repeats:]) for name, values in cpu.items()}
    _report(section, results, medians, cpu_medians, raw)
    section.notes.append(
        f"{repeats} repeats, interleaved, each a batch of ~0.15 s (at most {n:,} calls); "
        "sequential awaits on one event loop; a fresh key per call; the cache has L1 and the "
        "backplane on (the backplane listener of the same process reads every entry). "
        "On a single node set() is one script (SET, DEL lease, XADD: one command, one reply) "
        "and set_many one MULTI/EXEC (the SETs, one DEL of the leases, the append as an EVAL), both "
        "packed by layered_cache._direct; the listener pauses backplane.coalesce (1 ms) "
        "after a read that returned entries."
    )
    section.notes.append(
        f"'{UNHEARD.removeprefix(', ')}': a second cache, same config, its backplane listener "
        "stopped after start (comparison only: an instance that doesn't listen keeps stale "
        "L1 copies); its set() still appends to the stream. The gap to it is what the "
        "writer's own listener costs per set(): woken by its own entries at most once per "
        "coalesce interval, one XREAD and redis-py's parse of each entry."
    )
    section.notes.append(
        f"'{UNPOLLED.removeprefix(', ')}': a third cache with redis.busy_poll = 0s: it waits "
        "for each reply asleep in the event loop's epoll, as the floors (redis-py) do. The "
        "default (100us) polls the socket that long first (layered_cache._busypoll): on a VM "
        "being woken from epoll costs more than a nearby Redis's answer takes."
    )
    section.notes.append(
        "Raw-socket round trips (bench/raw_writes.py: pre-packed bytes on a blocking "
        "socket, read until whole: the round trip and Redis's work, next to no client "
        f"work): {summary(raw)}. The script's excess over SET is what the atomic "
        "write-and-announce costs on the server, where no client can win it back."
    )
    section.data = {"median_s": medians, "repeats_s": results, "cpu_median_s": cpu_medians,
                    "n": n, "raw_round_trips_s": raw}
    section.seconds = time.perf_counter() - started
    return section


def _pairs() -> dict[str, str]:
    """Each of our contenders -> its floor's name, ``{}`` standing for the client kind."""
    single, many = "floor: SET PX + encode ({})", f"floor: pipelined SET PX x{BATCH} + encode ({{}})"
    pairs = {}
    for label in ("", UNHEARD, UNPOLLED):
        pairs[f"layered_cache set(){label}"] = single
        pairs[f"layered_cache set_many ({BATCH} items){label}"] = many
    pairs[SAME_WRITES] = single
    return pairs


def _same_work(name: str, medians: dict[str, float], raw: dict[str, list[float]]) -> str:
    """For set(): the ratio of the same writes sent by hand (``_same_writes``), and what
    the write script takes over a bare SET on a raw socket (``raw_writes``)."""
    if not name.endswith("set()"):
        return ""
    base = medians["floor: SET PX + encode (default client)"]
    script = statistics.median(raw["EVALSHA write script"]) - statistics.median(raw["SET"])
    return (f"; the same writes by hand, one EVALSHA: {medians[SAME_WRITES] / base:.2f}x; "
            f"the script on a raw socket +{script * 1e6:.0f} µs over SET")


def _report(
    section: Section,
    results: dict[str, list[float]],
    medians: dict[str, float],
    cpu: dict[str, float],
    raw: dict[str, list[float]],
) -> None:
    pairs = _pairs()
    section.columns = ["contender", "median per call", "ratio to floor (default client)",
                       "ratio to floor (1 s timeout)", "CPU per call (ratio, default client)",
                       "min..max of repeats"]
    for name, values in results.items():
        floor = pairs.get(name)
        floor_name = floor.format("default client") if floor else name
        section.rows.append([
            name, fmt_us(medians[name]),
            fmt_ratio(medians[name], medians[floor_name]) if floor else "-",
            fmt_ratio(medians[name], medians[floor.format("1 s socket timeout")]) if floor else "-",
            f"{fmt_us(cpu[name])} ({fmt_ratio(cpu[name], cpu[floor_name])})"
            if floor else fmt_us(cpu[name]),
            f"{fmt_us(min(values))} .. {fmt_us(max(values))}",
        ])
    for name, floor in pairs.items():
        if name.endswith((UNHEARD, UNPOLLED)) or name == SAME_WRITES:
            continue
        base = medians[floor.format("default client")]
        same = medians[floor.format("1 s socket timeout")]
        ratio = medians[name] / base
        what = "set()" if name.endswith("set()") else f"set_many of {BATCH}"
        section.headline.append(
            Headline(
                f"{what} (sequential, L1 + backplane on)",
                f"{fmt_us(medians[name])} ({ratio:.2f}x floor; "
                f"{medians[name] / same:.2f}x with the same socket timeout; CPU "
                f"{cpu[name] / cpu[floor.format('default client')]:.2f}x; own listener "
                f"stopped {medians[name + UNHEARD] / base:.2f}x; busy_poll off "
                f"{medians[name + UNPOLLED] / base:.2f}x{_same_work(name, medians, raw)})",
                f"{floor.format('default client').removeprefix('floor: ')} {fmt_us(base)}",
                f"<= {TARGET}x floor",
                "ok" if ratio <= TARGET else "MISSED",
            )
        )
