"""Fan-out: what N backplane readers cost the stream's server (issue 20).

``python -m bench.fanout [--quick] [--modes direct,relay,tree]``

What: every instance follows one Redis Stream with a blocking ``XREAD``, so the stream's
master carries every instance's reads and every delivery. Per grid point (N readers, E
events/s, k keys per event) this measures, over a window:
- the server's CPU (``INFO cpu``: used_cpu_user + used_cpu_sys, delta), bytes out
  (``INFO stats`` total_net_output_bytes), XREAD calls/s (``INFO commandstats``);
- delivery latency p50/p99: a reader's receive time minus the publisher's
  ``time.time()`` in the entry;
- the readers' own CPU and the machine's busy share, to show who was the limit.

How: a private ``redis-server``; readers are cheap (``bench.fanout_readers``: 50 per
process, each its own connection running the library's XREAD loop); one publisher
appends entries like the library's (``keys``: msgpack list of ~20-char names,
``origin``: a 12-char instance id) plus ``t``, its clock, for the latency. In ``relay``
mode R relays (``python -m layered_cache relay``) follow the stream and the readers
connect to them instead; ``tree`` puts a second level of relays under the first.

The cost model and its validation are ``bench.fanout_model``; results go to
``bench/results/fanout.json`` and ``fanout.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import socket
import string
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis
import redis.asyncio as aioredis

from bench.fanout_readers import reader_process
from bench.report import RESULTS
from tests.servers import RedisServer, free_port

__all__ = ["Point", "main"]

STREAM = "layered_cache:invalidations"
MAXLEN = 100_000
PER_PROCESS = 50  # readers per reader process, up to MAX_PROCESSES processes
MAX_PROCESSES = 10
# Beyond this many deliveries/s the Python readers, not the server, are the limit on 2
# cores (they spend ~2x the server's CPU per delivery): such points are skipped.
MAX_DELIVERIES = 50_000
# Relays are Python too (asyncio streams): through them, less.
RELAY_MAX_N = 200
RELAY_MAX_DELIVERIES = 20_000
TREE_MIN_N = 100
WARMUP_S = 1.0
DRAIN_S = 0.3  # after the window: let in-flight deliveries reach the readers
JSON_PATH = RESULTS / "fanout.json"
READERS_NOTE = (
    "CPU in cores (1.0 = one core busy); rates per second over window_s; latencies in ms, "
    "receive time minus the publisher's time.time() in the entry's t field; relay_cpu per "
    "relay, a tree's top relays first; readers: asyncio.Protocol + minimal RESP2 parser, "
    "50 per process (at most 10 processes); machine_busy (from /proc/stat) disagreed with "
    "the processes' own CPU on the VM it was measured on: not used"
)


@dataclass
class Point:
    """One measured grid point (rates per second, CPU in cores: 1.0 = one core busy)."""

    mode: str  # "direct" (readers on Redis), "relay", "tree" (two levels of relays)
    n: int  # readers (instances)
    e: float  # target events/s
    k: int  # keys per event
    relays: int = 0  # relays the readers connect to (the leaves, in a tree)
    window_s: float = 0.0
    xadd_per_s: float = 0.0
    xread_per_s: float = 0.0  # XREADs the Redis server served (relays' upstream reads, in relay modes)
    redis_cpu: float = 0.0
    redis_bytes_out_per_s: float = 0.0
    xread_usec_per_call: float = 0.0  # INFO commandstats usec_per_call of XREAD
    reader_reads_per_s: float = 0.0  # reads the readers made (to Redis or to relays)
    deliveries_per_s: float = 0.0  # entries received by all readers
    expected_deliveries_per_s: float = 0.0  # XADDs x N
    entries_min: int = 0  # fewest entries one reader received (all should get all)
    entries_max: int = 0
    reconnects: int = 0  # reader reconnections during the window (should be 0)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    reader_cpu: float = 0.0
    relay_cpu: list[float] = field(default_factory=list)  # per relay, leaves last
    machine_busy: float = 0.0  # share of all cores busy, /proc/stat (unreliable on a VM)
    entry_bytes: float = 0.0  # mean RESP bytes of one delivered entry
    date: str = ""

    def key(self) -> tuple[str, int, float, int, int]:
        return (self.mode, self.n, self.e, self.k, self.relays)


# -- counters ---------------------------------------------------------------------------


def _redis_counters(client: redis.Redis) -> dict[str, float]:
    info: Any = client.info("all")
    xread = info.get("cmdstat_xread", {})
    xadd = info.get("cmdstat_xadd", {})
    return {
        "cpu": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        "bytes_out": float(info["total_net_output_bytes"]),
        "xread": float(xread.get("calls", 0)),
        "xread_usec": float(xread.get("usec", 0)),
        "xadd": float(xadd.get("calls", 0)),
    }


def _machine_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [float(v) for v in stat.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- readers ----------------------------------------------------------------------------


class ReaderPool:
    """N readers in ceil(N / 50) spawned processes (at most 10), driven over pipes."""

    def __init__(self, targets: list[tuple[str, int]], n: int, stream: bytes, start_id: bytes):
        ctx = mp.get_context("spawn")
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        processes = min(MAX_PROCESSES, math.ceil(n / PER_PROCESS))
        for i in range(processes):
            first, count = n * i // processes, n * (i + 1) // processes - n * i // processes
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=reader_process, daemon=True,
                               args=(child, targets, first, count, stream, start_id))  # fmt: skip
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._expect_all("ready", timeout=60)

    def _answer(self, index: int, what: str, timeout: float) -> Any:
        """The next message of process ``index``; raises if it died or stays silent."""
        deadline = time.monotonic() + timeout
        while not self._conns[index].poll(0.1):
            if not self._procs[index].is_alive():
                raise RuntimeError(f"reader process exited (code {self._procs[index].exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"reader process did not answer {what!r}")
        return self._conns[index].recv()

    def _expect_all(self, expected: str, timeout: float) -> None:
        for index in range(len(self._conns)):
            answer = self._answer(index, expected, timeout)
            if answer != expected:
                raise RuntimeError(f"reader process: {answer}")

    def reset(self) -> None:
        for conn in self._conns:
            conn.send("reset")
        self._expect_all("ok", timeout=30)

    def collect(self) -> dict[str, Any]:
        """Merged counts of every process since the last reset."""
        for conn in self._conns:
            conn.send("collect")
        merged: dict[str, Any] = {"latencies": array("d"), "reads": 0, "entries": 0,
                                  "cpu": 0.0, "entries_min": None, "entries_max": 0, "reconnects": 0}  # fmt: skip
        for index in range(len(self._conns)):
            part = self._answer(index, "collect", 60)
            if isinstance(part, str):
                raise RuntimeError(f"reader process: {part}")
            merged["latencies"].frombytes(part["latencies"])
            for name in ("reads", "entries", "cpu", "reconnects"):
                merged[name] += part[name]
            low = merged["entries_min"]
            merged["entries_min"] = part["entries_min"] if low is None else min(low, part["entries_min"])
            merged["entries_max"] = max(merged["entries_max"], part["entries_max"])
        return merged

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send("stop")
        for proc in self._procs:
            proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


# -- relays -----------------------------------------------------------------------------


def relay_available() -> bool:
    """Whether this checkout has the relay (``layered_cache/_relay.py``)."""
    import importlib.util

    return importlib.util.find_spec("layered_cache._relay") is not None


def _answers_xread(address: tuple[str, int], stream: bytes) -> bool:
    """Whether ``address`` answers a short XREAD on ``stream`` (a relay closes clients
    until it follows the stream)."""
    from bench.fanout_readers import Incomplete, parse_reply

    command = [b"XREAD", b"COUNT", b"1", b"BLOCK", b"1", b"STREAMS", stream, b"$"]
    wire = b"*%d\r\n" % len(command) + b"".join(b"$%d\r\n%s\r\n" % (len(c), c) for c in command)
    with contextlib.suppress(OSError, RuntimeError), socket.create_connection(address, 1) as sock:
        sock.sendall(wire)
        buf = b""
        while chunk := sock.recv(65536):
            buf += chunk
            with contextlib.suppress(Incomplete):
                parse_reply(buf)
                return True
    return False


def _wait_serving(address: tuple[str, int], stream: bytes, proc: subprocess.Popen[bytes],
                  timeout: float) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"relay exited with code {proc.returncode}")
        if _answers_xread(address, stream):
            return
        time.sleep(0.05)
    raise TimeoutError(f"relay on {address} does not answer XREAD after {timeout:.0f} s")


class Relays:
    """Relay processes (``python -m layered_cache relay``): each follows Redis, or
    another relay (``--upstream``: it speaks the same XREAD)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="lc-fanout-relays-"))
        self._config = self._dir / "app.toml"
        self._config.write_text(
            f'[redis]\nurl = "{redis_url}"\nprefix = "{prefix}"\n\n[logging]\nlevel = "warning"\n'
            '\n[namespaces.book]\nkey = "book:{id}"\n'
        )
        self._stream = (prefix + STREAM).encode()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, upstream: tuple[str, int] | None = None) -> tuple[str, int]:
        """One more relay following Redis (or the relay at ``upstream``); returns where
        it listens once it answers XREAD."""
        address = ("127.0.0.1", free_port())
        command = [sys.executable, "-m", "layered_cache", "relay", "--config", str(self._config),
                   "--listen", f"{address[0]}:{address[1]}"]  # fmt: skip
        if upstream is not None:
            command += ["--upstream", f"redis://{upstream[0]}:{upstream[1]}/0"]
        log = open(self._dir / f"relay{len(self.procs)}.log", "wb")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self._dir)  # fmt: skip
        self.procs.append(proc)
        try:
            _wait_serving(address, self._stream, proc, timeout=30)
        except (RuntimeError, TimeoutError) as exc:
            tail = (self._dir / f"relay{len(self.procs) - 1}.log").read_text(errors="replace")
            raise RuntimeError(f"{exc}; its log ends:\n{tail[-2000:]}") from None
        return address

    def cpu(self) -> list[float]:
        return [process_cpu(p.pid) for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


# -- publisher --------------------------------------------------------------------------


def key_names(count: int, rng: random.Random) -> list[str]:
    """Realistic key names of 20 characters (``app:book:`` + 11 digits)."""
    return [f"app:book:{rng.randrange(10**11):011d}" for _ in range(count)]


async def publish(client: aioredis.Redis, stream: str, rate: float, k: int, seconds: float,
                  origin: str, rng: random.Random) -> int:  # fmt: skip
    """XADD ``rate`` entries/s for ``seconds``, evenly spaced; returns entries sent."""
    loop = asyncio.get_running_loop()
    if rate <= 0:
        await asyncio.sleep(seconds)
        return 0
    start, sent = loop.time(), 0
    while sent / rate < seconds:
        delay = start + sent / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        fields = {"keys": msgspec.msgpack.encode(key_names(k, rng)), "origin": origin,
                  "t": f"{time.time():.6f}"}  # fmt: skip
        await client.xadd(stream, fields, maxlen=MAXLEN, approximate=True)  # type: ignore[arg-type]
        sent += 1
    return sent


def entry_resp_bytes(k: int) -> float:
    """RESP bytes of one delivered entry as the publisher writes it (k ~20-char keys)."""
    rng = random.Random(0)
    fields = [b"keys", msgspec.msgpack.encode(key_names(k, rng)), b"origin", b"x" * 12,
              b"t", f"{time.time():.6f}".encode()]  # fmt: skip
    entry_id = b"%d-0" % int(time.time() * 1000)
    bulk = sum(len(b"$%d\r\n\r\n" % len(f)) + len(f) for f in [entry_id, *fields])
    return bulk + len(b"*2\r\n") + len(b"*%d\r\n" % len(fields))


# -- one grid point ---------------------------------------------------------------------


@dataclass
class Setup:
    """What every point of one (mode, N, relays) shares."""

    mode: str
    n: int
    relays: int
    redis_client: redis.Redis
    async_client: aioredis.Redis
    stream: str
    pool: ReaderPool
    relay_set: Relays | None
    origin: str = field(default_factory=lambda: "".join(random.choices(string.ascii_lowercase, k=12)))


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def measure(setup: Setup, e: float, k: int, window: float) -> Point:
    """Warm up, then one window at ``e`` events/s of ``k`` keys."""
    rng = random.Random(f"{setup.n}-{e}-{k}")
    stream, client = setup.stream, setup.async_client
    await publish(client, stream, e, k, WARMUP_S, setup.origin, rng)
    setup.pool.reset()
    before = _redis_counters(setup.redis_client)
    machine0 = _machine_times()
    relay0 = setup.relay_set.cpu() if setup.relay_set else []
    t0 = time.monotonic()
    await publish(client, stream, e, k, window, setup.origin, rng)
    elapsed = time.monotonic() - t0
    after = _redis_counters(setup.redis_client)
    machine1 = _machine_times()
    relay1 = setup.relay_set.cpu() if setup.relay_set else []
    await asyncio.sleep(DRAIN_S)
    readers = setup.pool.collect()
    return _point(setup, e, k, elapsed, before, after, (machine0, machine1), relay0, relay1,
                  readers)  # fmt: skip


def _point(setup: Setup, e: float, k: int, elapsed: float, before: dict[str, float],
           after: dict[str, float], machine: tuple[tuple[float, float], tuple[float, float]],
           relay0: list[float], relay1: list[float], readers: dict[str, Any]) -> Point:  # fmt: skip
    def rate(name: str) -> float:
        return (after[name] - before[name]) / elapsed

    xreads = after["xread"] - before["xread"]
    latencies = sorted(readers["latencies"])
    (busy0, total0), (busy1, total1) = machine
    xadd = rate("xadd")
    return Point(
        mode=setup.mode, n=setup.n, e=e, k=k, relays=setup.relays, window_s=round(elapsed, 3),
        xadd_per_s=xadd, xread_per_s=rate("xread"), redis_cpu=rate("cpu"),
        redis_bytes_out_per_s=rate("bytes_out"),
        xread_usec_per_call=(after["xread_usec"] - before["xread_usec"]) / xreads if xreads else 0.0,
        reader_reads_per_s=readers["reads"] / elapsed,
        deliveries_per_s=readers["entries"] / elapsed,
        expected_deliveries_per_s=xadd * setup.n,
        entries_min=readers["entries_min"] or 0, entries_max=readers["entries_max"],
        reconnects=readers["reconnects"],
        p50_ms=_percentile(latencies, 50) * 1000, p99_ms=_percentile(latencies, 99) * 1000,
        reader_cpu=readers["cpu"] / elapsed,
        relay_cpu=[(b - a) / elapsed for a, b in zip(relay0, relay1, strict=True)],
        machine_busy=(busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0,
        entry_bytes=entry_resp_bytes(k), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    )  # fmt: skip


# -- the grid ---------------------------------------------------------------------------


@dataclass
class Grid:
    ns: list[int]
    rates: list[float]
    keys: list[int]
    window: float
    relay_counts: list[int]
    modes: list[str]

    max_deliveries: float = MAX_DELIVERIES
    relay_max_n: int = RELAY_MAX_N

    tree_relays: list[int] = field(default_factory=lambda: [4])

    def sizes(self, mode: str) -> list[int]:
        """N per mode; a tree of 4 leaves with 10 readers says little: 100 and up."""
        if mode == "direct":
            return self.ns
        smallest = TREE_MIN_N if mode == "tree" else 0
        return [n for n in self.ns if smallest <= n <= self.relay_max_n]

    def relays(self, mode: str) -> list[int]:
        return {"direct": [0], "relay": self.relay_counts}.get(mode, self.tree_relays)

    def budget(self, mode: str) -> float:
        return self.max_deliveries if mode == "direct" else RELAY_MAX_DELIVERIES

    def loads(self, mode: str, n: int) -> Iterator[tuple[float, int]]:
        """(E, k) pairs: idle once (k does not matter without events), then each rate x k
        up to the mode's budget of deliveries per second."""
        yield 0.0, 1
        for e in self.rates:
            if n * e <= self.budget(mode):
                for k in self.keys if mode != "tree" else self.keys[:1]:
                    yield e, k


def _start_id(client: redis.Redis, stream: str) -> bytes:
    """The stream's newest ID (created with a keyless entry, as the listener does)."""
    newest: Any = client.xrevrange(stream, count=1)
    if newest:
        return bytes(newest[0][0])
    return bytes(client.xadd(stream, {"origin": "-"}))  # type: ignore[arg-type]


@contextlib.contextmanager
def _setup(server: RedisServer, mode: str, n: int, relays: int) -> Iterator[Setup]:
    prefix = f"bench-fanout-{random.randrange(16**6):06x}:"
    stream = prefix + STREAM
    sync = server.client()
    start_id = _start_id(sync, stream)
    relay_set: Relays | None = None
    pool: ReaderPool | None = None
    async_client = aioredis.Redis.from_url(server.url)
    try:
        targets = [(server.host, server.port)]
        if mode != "direct":
            relay_set = Relays(server.url, prefix)
            targets = _start_relays(relay_set, mode, relays)
        pool = ReaderPool(targets, n, stream.encode(), start_id)
        yield Setup(mode, n, relays, sync, async_client, stream, pool, relay_set)
    finally:
        if pool is not None:
            pool.close()
        if relay_set is not None:
            relay_set.close()
        sync.delete(stream)
        sync.close()


def _start_relays(relays: Relays, mode: str, count: int) -> list[tuple[str, int]]:
    """``relay``: ``count`` relays on Redis. ``tree``: sqrt(count) relays on Redis and
    ``count`` leaves spread over them; the readers go to the leaves."""
    if mode == "relay":
        return [relays.start() for _ in range(count)]
    tops = [relays.start() for _ in range(max(1, round(math.sqrt(count))))]
    return [relays.start(tops[i % len(tops)]) for i in range(count)]


async def run_grid(server: RedisServer, grid: Grid, done: list[Point],
                   failures: list[str] | None = None) -> None:  # fmt: skip
    """Every (mode, N, relays) setup once, every load on it; appends to ``done``. A
    setup that fails (a relay that won't start) is recorded in ``failures`` and the
    grid goes on; without ``failures`` it raises."""
    for mode in grid.modes:
        for n in grid.sizes(mode):
            for relays in grid.relays(mode):
                try:
                    await _run_setup(server, grid, mode, n, relays, done)
                except Exception as exc:
                    if failures is None:
                        raise
                    failures.append(f"{mode} N={n} R={relays}: {type(exc).__name__}: {exc}")
                    print(f"FAILED {failures[-1]}", flush=True)


async def _run_setup(server: RedisServer, grid: Grid, mode: str, n: int, relays: int,
                     done: list[Point]) -> None:  # fmt: skip
    with _setup(server, mode, n, relays) as setup:
        try:
            for e, k in grid.loads(mode, n):
                point = await measure(setup, e, k, grid.window)
                done.append(point)
                print(_line(point), flush=True)
        finally:
            await setup.async_client.aclose()


def _line(p: Point) -> str:
    relays = f" R={p.relays}" if p.relays else ""
    return (f"{p.mode:6} N={p.n:4}{relays} E={p.e:5g} k={p.k:2}: redis {p.redis_cpu * 100:5.1f}% "
            f"out {p.redis_bytes_out_per_s / 1e6:6.2f} MB/s xread {p.xread_per_s:7.0f}/s "
            f"deliv {p.deliveries_per_s:7.0f}/{p.expected_deliveries_per_s:7.0f} "
            f"in {p.reader_reads_per_s:7.0f} reads "
            f"p50 {p.p50_ms:6.2f} p99 {p.p99_ms:7.2f} ms readers {p.reader_cpu * 100:5.1f}% "
            f"relays {sum(p.relay_cpu) * 100:5.1f}%")  # fmt: skip


# -- results ----------------------------------------------------------------------------


def load_points() -> list[Point]:
    try:
        raw = json.loads(JSON_PATH.read_text())
    except (OSError, ValueError):
        return []
    known = set(Point.__dataclass_fields__)
    return [Point(**{k: v for k, v in p.items() if k in known}) for p in raw.get("points", [])]


def save(points: list[Point], failures: list[str], keep_modes: bool) -> list[Point]:
    """Write the JSON; ``keep_modes``: keep earlier points of modes this run did not
    measure (``--modes relay,tree`` adds relay points to a direct run's)."""
    from bench.env import machine_info

    measured = {p.mode for p in points}
    payload: dict[str, Any] = {"machine": machine_info(), "readers": READERS_NOTE,
                               "failures": failures}  # fmt: skip
    if keep_modes:
        points = [p for p in load_points() if p.mode not in measured] + points
        if "direct" not in measured:  # a repeat of the direct grid stays with it
            with contextlib.suppress(OSError, ValueError, KeyError):
                payload["repeat_direct"] = json.loads(JSON_PATH.read_text())["repeat_direct"]
    payload["points"] = [asdict(p) for p in points]
    RESULTS.mkdir(parents=True, exist_ok=True)
    JSON_PATH.write_text(json.dumps(payload, indent=1) + "\n")
    return points


PLOT_RATES = (10.0, 100.0, 250.0, 1000.0)
RELAY_GROUP = 50  # the plot's relay line: one relay per 50 instances


def _upto_one_core(values: list[float]) -> list[float]:
    """CPU in % of a core, cut where it reaches one core (the model ends there)."""
    return [v * 100 if v < 1.0 else math.nan for v in values]


def plot(points: list[Point], fit: Any) -> str:
    """Measured points against the model's lines, extrapolated to 10,000 readers: the
    Redis node's CPU, one relay's CPU, Redis's bytes out, and delivery p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from bench.fanout_model import bytes_per_s, leaf_cpu

    entry = next((p.entry_bytes for p in points if p.k == 1), 120.0)
    ns = np.logspace(1, 4, 80)
    fig, axes = plt.subplots(1, 4, figsize=(21, 5.4))
    cpu_ax, relay_ax, bytes_ax, p99_ax = axes
    for i, e in enumerate(PLOT_RATES):
        color = f"C{i}"
        cpu_ax.plot(ns, _upto_one_core([fit.redis.at(n, e) for n in ns]), color=color,
                    label=f"model, today, E = {e:g}/s")  # fmt: skip
        cpu_ax.plot(ns, _upto_one_core([fit.redis.at(max(1.0, n / RELAY_GROUP), e) for n in ns]),
                    color=color, ls="--", label=f"model, 1 relay per {RELAY_GROUP}")  # fmt: skip
        if fit.relay is not None:
            relay_ax.plot(ns, _upto_one_core([fit.relay.at(n, e) for n in ns]), color=color,
                          label=f"model, E = {e:g}/s")  # fmt: skip
        bytes_ax.plot(ns, [bytes_per_s(n, e, entry, fit.header) for n in ns], color=color,
                      label=f"model, E = {e:g}/s")  # fmt: skip
    _scatter(cpu_ax, points, lambda p: p.n, lambda p: p.redis_cpu * 100)
    relayed = [p for p in points if p.mode != "direct"]
    _scatter(relay_ax, relayed, lambda p: p.n / p.relays, lambda p: leaf_cpu(p) * 100)
    _scatter(bytes_ax, [p for p in points if p.mode == "direct"], lambda p: p.n,
             lambda p: p.redis_bytes_out_per_s)  # fmt: skip
    for ax in (cpu_ax, relay_ax):
        ax.axhline(100, color="black", lw=0.8)
        ax.text(12, 110, "one core", fontsize=8)
    _p99_panel(p99_ax, points, fit, ns)
    titles = ("Redis CPU (% of one core)", "one relay's CPU (% of one core)",
              "Redis bytes out per second", "delivery p99 (ms)")  # fmt: skip
    xlabels = ("instances N", "instances per relay", "instances N", "instances N")
    for ax, title, xlabel in zip(axes, titles, xlabels, strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("Backplane fan-out, k = 1 key per entry: measured (markers; hollow = check "
                 "points, not fitted) vs model (lines, to one core); loopback, 2 shared cores",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "fanout.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


_MARKERS = {"direct": "o", "relay": "s", "tree": "^"}


def _scatter(ax: Any, points: list[Point], x: Any, y: Any) -> None:
    """Measured points at E > 0 and k = 1, coloured by E like the model lines; direct
    readers circles, relays squares, trees triangles; filled = fitted, hollow = check."""
    from bench.fanout_model import fit_all

    fitted = {id(p) for p in fit_all(points, STREAM).fit_points}
    for p in points:
        if p.e <= 0 or p.k != 1:
            continue
        color = f"C{PLOT_RATES.index(p.e)}" if p.e in PLOT_RATES else "gray"
        ax.scatter([x(p)], [y(p)], marker=_MARKERS.get(p.mode, "x"), s=30, zorder=3,
                   facecolors=color if id(p) in fitted else "none", edgecolors=color)  # fmt: skip
    for mode, marker in _MARKERS.items():
        if any(p.mode == mode for p in points):
            ax.scatter([], [], marker=marker, color="gray", label=f"measured, {mode}")


def _p99_panel(ax: Any, points: list[Point], fit: Any, ns: Any) -> None:
    ax.plot(ns, [fit.latency.p99(n) for n in ns], color="C3", label="model, today")
    ax.plot(ns, [fit.latency.p50(n) for n in ns], color="C3", ls=":", label="model p50, today")
    for p in points:
        if p.e > 0 and p.k == 1 and not math.isnan(p.p99_ms):
            ax.scatter([p.n], [p.p99_ms], marker=_MARKERS.get(p.mode, "x"), s=25,
                       color="C3" if p.mode == "direct" else "C2", zorder=3)  # fmt: skip
    if fit.relay_latency is not None:
        ax.plot(ns, [fit.relay_latency.p99(RELAY_GROUP)] * len(ns), color="C2", ls="--",
                label=f"model, 1 relay per {RELAY_GROUP}")  # fmt: skip


async def run(env: Any) -> Any:
    """``make bench``'s scenario ``fanout``: a short direct run (N = 10, 100, 200; idle and
    100 events/s; 3 s windows) against the model fitted on the last full run
    (``fanout.json``; ``python -m bench.fanout`` makes it), which it does not overwrite."""
    from bench.fanout_model import docs_table, fit_all
    from bench.report import Headline, Section

    started = time.perf_counter()
    grid = Grid([10, 100, 200], [100.0], [1], 3.0, [], ["direct"])
    points: list[Point] = []
    await run_grid(env.own_redis(), grid, points)
    reference = [p for p in load_points() if p.mode == "direct"] or points
    fit = fit_all(reference, "bench-fanout-000000:" + STREAM)
    columns, rows = docs_table(points, fit)
    busiest = max(points, key=lambda p: p.redis_cpu)
    predicted = fit.predict_redis(busiest)
    section = Section("fanout", "Backplane fan-out: N readers on the stream's Redis", columns,
                      rows, seconds=time.perf_counter() - started)  # fmt: skip
    section.notes = [
        "measured / model; the model is the one fitted by the last full run "
        "(`python -m bench.fanout`, docs/operations.md \"Fan-out\")",
        "readers: 50 per process, the library's XREAD loop each (bench/fanout_readers.py)",
    ]
    section.data = {"points": [asdict(p) for p in points]}
    section.headline = [Headline(
        f"fan-out: Redis CPU, N = {busiest.n} readers, {busiest.e:g} events/s",
        f"{busiest.redis_cpu * 100:.1f} % of a core", f"model {predicted * 100:.1f} %",
        "model within its stated error", "info",
    )]  # fmt: skip
    return section


def _grid(args: argparse.Namespace) -> Grid:
    if args.quick:
        return Grid([10, 100], [100.0], [1], 2.0, [1, 2], args.modes, tree_relays=[2])
    return Grid(args.n, args.e, args.k, args.window, args.relays, args.modes, args.max_deliveries,
                tree_relays=args.tree_relays)  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 N, 1 rate, 2 s windows")
    parser.add_argument("--n", type=_ints, default=[10, 100, 200, 500, 1000],
                        help="readers, e.g. 10,100 (relay modes: at most 200)")  # fmt: skip
    parser.add_argument("--e", type=lambda t: [float(x) for x in t.split(",")],
                        default=[10.0, 100.0, 250.0], help="events/s besides idle")  # fmt: skip
    parser.add_argument("--k", type=_ints, default=[1, 10], help="keys per event")
    parser.add_argument("--window", type=float, default=6.0, help="seconds per point")
    parser.add_argument("--max-deliveries", type=float, default=MAX_DELIVERIES,
                        help="skip points with more deliveries/s (N x E) than this")  # fmt: skip
    parser.add_argument("--relays", type=_ints, default=[1, 2, 4], help="R in relay mode")
    parser.add_argument("--tree-relays", type=_ints, default=[4],
                        help="leaf relays in tree mode (round(sqrt) of them on Redis)")  # fmt: skip
    parser.add_argument("--modes", type=lambda t: t.split(","), default=None,
                        help="direct,relay,tree (default: direct, plus relay and tree when "
                             "layered_cache/_relay.py exists)")  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.modes is None:
        args.modes = ["direct", "relay", "tree"] if relay_available() else ["direct"]
    points: list[Point] = []
    failures: list[str] = []
    with RedisServer() as server:
        try:
            asyncio.run(run_grid(server, _grid(args), points, failures))
        finally:
            if points and not args.no_write:
                points = save(points, failures, keep_modes=True)
    for failure in failures:
        print(f"failed: {failure}")
    if points and not args.no_write:
        from bench.fanout_model import report

        print(report(points, plot=lambda fit: plot(points, fit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
