"""Scenario 17: the bookstore end to end, a real server driven by wrk, with and without
the cache; and where an L1-hit request's time goes.

What: ``GET /books/{id}`` over 16 hot ids (a wrk Lua script requests them in turn),
``wrk -t2 -c64 --latency``, against the example (examples/bookstore: Starlette, SQLite in
memory with its default 20 ms ``BOOKSTORE_QUERY_DELAY``) served by uvicorn in a process of
its own (one worker), in four configurations of namespace ``book`` (bench/e2e_app.py):

- (a) as shipped, warm: every request an L1 hit;
- (b) ``l1 = false``, warm: every request an L2 hit (one GET to Redis);
- (c) ``cache = false``: every request the database join (+ the 20 ms delay);
- (c0) ``cache = false`` with no delay: SQLite's join alone, in its worker thread.

All four servers run during the whole measurement (idle ones cost nothing), and the wrk
runs are interleaved: repeat 1 of every configuration, then repeat 2, ...; medians of
requests/s, p99, and the server's CPU time per request (``/proc/PID/stat`` around each
run: the figure a neighbour's burst disturbs least).

Profile: the same app in this process (configuration (a), warm), called straight through
ASGI (a scope, a ``receive`` and a ``send`` that keeps the status: no sockets, no HTTP
parsing). Two methods: (1) wall time, interleaved batches: a whole request vs the very
``cache.get_or_load("book", {"id": i}, loader)`` the endpoint makes, share = ratio of the
medians; (2) cProfile over the same requests: the cumulative time of
``get_or_load`` and the own time of every layered_cache frame (``CachedResponses``' ETag
and headers too) over the cumulative time of ``Starlette.__call__``.

Why: the micro-benchmarks time the cache alone; this says what it buys a real service
and what share of a served request it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import os
import pstats
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.env import BenchEnv, unique_prefix
from bench.floors import fmt_us, interleaved, median
from bench.report import Headline, Section
from bench.wrk import WrkResult, run_wrk

ROOT = Path(__file__).resolve().parents[1]
IDS = list(range(1, 17))  # the hot set: 16 books, so (a) is L1 hits once warm
THREADS, CONNECTIONS = 2, 64
QUERY_DELAY = 0.02  # the example's default BOOKSTORE_QUERY_DELAY
# label -> (E2E_MODE, BOOKSTORE_QUERY_DELAY)
CONFIGS: dict[str, tuple[str, float]] = {
    "(a) L1 hit": ("l1", QUERY_DELAY),
    "(b) L2 hit (l1 = false)": ("l2", QUERY_DELAY),
    "(c) no cache (cache = false), DB delay 20 ms": ("db", QUERY_DELAY),
    "(c0) no cache, no DB delay (SQLite join only)": ("db", 0.0),
}
A, B, C, C0 = CONFIGS
SHORT = {A: "(a) L1 hit", B: "(b) L2 hit", C: "(c) no cache", C0: "(c0) no cache, no DB delay"}


def _server_env(mode: str, delay: float, redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LAYERED_CACHE_") and k not in ("KAFKA_BOOTSTRAP", "DATABASE_URL")}  # fmt: skip
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        E2E_MODE=mode, E2E_PREFIX=unique_prefix(f"e2e-{mode}"), REDIS_URL=redis_url,
        BOOKSTORE_QUERY_DELAY=str(delay),
    )  # fmt: skip
    return env


async def _wait_ready(proc: asyncio.subprocess.Process, base: str, timeout: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"uvicorn exited with {proc.returncode} during startup")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{base} not ready after {timeout:g} s")


@contextlib.asynccontextmanager
async def _servers(redis_url: str) -> AsyncIterator[dict[str, tuple[str, int]]]:
    """One uvicorn process per configuration; yields label -> (base URL, pid)."""
    from tests.servers import free_port

    procs: list[asyncio.subprocess.Process] = []
    bases: dict[str, str] = {}
    try:
        for label, (mode, delay) in CONFIGS.items():
            port = free_port()
            # --loop asyncio --http h11: what uvicorn picks without uvloop/httptools;
            # explicit so the figures don't change with what is installed (uvloop is, for
            # tests/test_busy_poll.py).
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "uvicorn", "--factory", "bench.e2e_app:create_app",
                "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                "--loop", "asyncio", "--http", "h11", "--log-level", "warning", "--no-access-log",
                cwd=ROOT, env=_server_env(mode, delay, redis_url),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            procs.append(proc)
            bases[label] = f"http://127.0.0.1:{port}"
        for proc, base in zip(procs, bases.values(), strict=True):
            await _wait_ready(proc, base)
        yield {
            label: (base, proc.pid)
            for (label, base), proc in zip(bases.items(), procs, strict=True)
        }
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _stats(base: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        body: dict[str, Any] = (await client.get("/stats")).json()
    return {"cache": body["cache"].get("book", {}), "db": body["db"]["queries"]}


async def _warm(base: str, paths: list[str]) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=5) as client:
        for _ in range(2):
            for path in paths:
                (await client.get(path)).raise_for_status()


def _counted(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """What the server counted during the measured runs: the proof of each configuration."""

    def delta(section: str, name: str) -> int:
        return int(after[section].get(name, 0)) - int(before[section].get(name, 0))

    return {
        "l1_hit": delta("cache", "l1_hit"),
        "l2_hit": delta("cache", "l2_hit"),
        # a request arriving while the same key's L2 read is in flight joins it
        "coalesced": delta("cache", "coalesced"),
        "load": delta("cache", "load"),
        "db_book_detail": delta("db", "book_detail"),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used (all its threads: SQLite's worker too)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def _load(
    env: BenchEnv, seconds: int, repeats: int
) -> tuple[dict[str, list[WrkResult]], dict[str, list[float]], dict[str, Any]]:
    """wrk runs, the server's CPU seconds per request of each run, and what it counted.

    CPU per request is the steadier figure on a shared machine: a neighbour's burst
    lowers the requests/s of a run, but the server's CPU time per request it answered
    much less (a clock tick is 10 ms: over a run of seconds, well under 1 %)."""
    paths = [f"/books/{i}" for i in IDS]
    runs: dict[str, list[WrkResult]] = {label: [] for label in CONFIGS}
    cpu: dict[str, list[float]] = {label: [] for label in CONFIGS}
    async with _servers(env.redis_url()) as servers:
        for base, _ in servers.values():
            await _warm(base, paths)
            await run_wrk(base, paths, 1, THREADS, CONNECTIONS)  # warm-up run, discarded
        before = {label: await _stats(base) for label, (base, _) in servers.items()}
        for _ in range(repeats):
            for label, (base, pid) in servers.items():
                used = _cpu_seconds(pid)
                result = await run_wrk(base, paths, seconds, THREADS, CONNECTIONS)
                cpu[label].append((_cpu_seconds(pid) - used) / max(1, result.requests))
                runs[label].append(result)
        counted = {
            label: _counted(before[label], await _stats(base))
            for label, (base, _) in servers.items()
        }
    return runs, cpu, counted


# -- the in-process profile ------------------------------------------------------------


def _asgi_request(app: Any, book_id: int) -> Callable[[], Awaitable[int]]:
    """One ``GET /books/{id}`` straight into the ASGI app; returns the status."""
    template = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "GET", "scheme": "http", "path": f"/books/{book_id}",
        "raw_path": f"/books/{book_id}".encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"accept", b"*/*")],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    message = {"type": "http.request", "body": b"", "more_body": False}
    status = [0]

    async def receive() -> dict[str, Any]:
        return message

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status[0] = msg["status"]

    async def call() -> int:
        await app(dict(template), receive, send)  # a fresh scope: Starlette adds to it
        return status[0]

    return call


def _by_package(stats: dict[Any, Any], ours: str) -> dict[str, float]:
    """Own (tottime) seconds per package: layered_cache, starlette, asyncio, builtins..."""
    totals: dict[str, float] = defaultdict(float)
    for (filename, _, _), (_, _, tottime, _, _) in stats.items():
        if filename.startswith(ours):
            name = "layered_cache"
        elif "site-packages/" in filename:
            name = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        elif filename == "~":
            name = "builtins (C functions and methods)"
        elif "/examples/" in filename:
            name = "examples (the endpoint)"
        elif filename == __file__:
            name = "bench (the ASGI driver: scope, receive, send)"
        elif "/lib/python" in filename:
            name = (
                "stdlib " + Path(filename).stem
                if Path(filename).parent.name.startswith("python")
                else "stdlib " + Path(filename).parent.name
            )
        else:
            name = filename
        totals[name] += tottime
    return dict(totals)


async def _profile(env: BenchEnv, requests: int, repeats: int) -> dict[str, Any]:
    import layered_cache
    from bench.e2e_app import bookstore_config
    from examples.bookstore.app import BookstoreSettings, create_app
    from examples.bookstore.db import SQLiteDatabase

    db = SQLiteDatabase(":memory:", query_delay=0.0)
    config = bookstore_config("l1", env.redis_url(), unique_prefix("e2e-profile"))
    app = create_app(BookstoreSettings(config=config, db=db, produce_events=False))
    calls = [_asgi_request(app, book_id) for book_id in IDS]
    try:
        async with app.router.lifespan_context(app):
            cache = app.state.cache
            service = app.state.service
            for call in calls:
                if await call() != 200:
                    raise RuntimeError("GET /books/{id} in-process did not answer 200")
            loaders = [(book_id, lambda i=book_id: service.load_book(i)) for book_id in IDS]

            async def request_batch(n: int) -> float:
                t0 = time.perf_counter()
                for k in range(n):
                    await calls[k % len(calls)]()
                return (time.perf_counter() - t0) / n

            async def get_or_load_batch(n: int) -> float:
                t0 = time.perf_counter()
                for k in range(n):
                    book_id, loader = loaders[k % len(loaders)]
                    await cache.get_or_load("book", {"id": book_id}, loader)
                return (time.perf_counter() - t0) / n

            timed = await interleaved(
                {"request": request_batch, "get_or_load": get_or_load_batch}, requests, repeats
            )
            l1_before = cache.stats()["book"]["l1_hit"]
            profiler = cProfile.Profile()
            profiler.enable()
            for k in range(requests):
                await calls[k % len(calls)]()
            profiler.disable()
            l1_hits = cache.stats()["book"]["l1_hit"] - l1_before
    finally:
        await db.close()
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ours = str(Path(layered_cache.__file__).parent) + os.sep

    def cumulative(path_end: str, func: str) -> float:
        return sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(path_end) and fn == func)

    total = cumulative("starlette/applications.py", "__call__")
    return {
        "request_s": median(timed["request"]),
        "get_or_load_s": median(timed["get_or_load"]),
        "timed_share": median(timed["get_or_load"]) / median(timed["request"]),
        "profile_requests": requests,
        "profile_l1_hits": l1_hits,
        "profile_total_s": total,
        # The cache's read, whichever way the endpoint reaches it: the facade's
        # ``get_or_load``, the namespace's (``cache.cached``), and ``Namespace._serve``,
        # which the example's book page reads through (``CachedResponses.respond``). An
        # L1 hit of the first two never reaches ``_serve``: on this all-hits profile
        # nothing is counted twice.
        "profile_get_or_load_share": (
            cumulative("layered_cache/_hits.py", "get_or_load")
            + cumulative("layered_cache/_namespace.py", "get_or_load")
            + cumulative("layered_cache/_namespace.py", "_serve")
        )
        / total,
        "profile_layered_cache_share": sum(
            v[2] for (f, _, _), v in stats.items() if f.startswith(ours)
        )
        / total,
        "profile_by_package_s": _by_package(stats, ours),
        "repeats": timed,
    }


# -- the section -------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} µs"


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("e2e_wrk", "17. End to end: the bookstore under wrk, L1 / L2 / no cache; "
                                 "an L1-hit request profiled")  # fmt: skip
    if shutil.which("wrk") is None:
        section.error = "wrk not installed (apt-get install wrk)"
        return section
    seconds, repeats = (2, 1) if env.quick else (3, 5)
    runs, cpu_runs, counted = await _load(env, seconds, repeats)
    cpu = {label: median(values) for label, values in cpu_runs.items()}
    rps = {label: median([r.requests_per_s for r in rs]) for label, rs in runs.items()}
    p99 = {label: median([r.p99_s for r in rs]) for label, rs in runs.items()}
    p50 = {label: median([r.latency_s["50%"] for r in rs]) for label, rs in runs.items()}
    errors = {label: sum(r.non_2xx + r.socket_errors for r in rs) for label, rs in runs.items()}
    section.columns = ["GET /books/{id}, 16 ids", "requests/s", "range", "x (c)", "p50", "p99",
                       "x (c)", "server CPU / request", "x (c)", "requests (wrk)",
                       "L1 hits / L2 reads / joined a read / DB joins", "errors"]  # fmt: skip
    for label in CONFIGS:
        c = counted[label]
        section.rows.append([
            label, f"{rps[label]:,.0f}",
            f"{min(r.requests_per_s for r in runs[label]):,.0f}-{max(r.requests_per_s for r in runs[label]):,.0f}",
            f"{rps[label] / rps[C]:.2f}x", _ms(p50[label]), _ms(p99[label]),
            f"{p99[label] / p99[C]:.2f}x",
            fmt_us(cpu[label]),
            f"{cpu[label] / cpu[C]:.2f}x",
            f"{sum(r.requests for r in runs[label]):,}",
            f"{c['l1_hit']:,} / {c['l2_hit']:,} / {c['coalesced']:,} / {c['db_book_detail']:,}",
            str(errors[label]),
        ])  # fmt: skip
    section.rows.append(["(a) vs (b)", f"{rps[A] / rps[B]:.2f}x", "", "", "", f"{p99[A] / p99[B]:.2f}x",
                         "", f"{cpu[A] / cpu[B]:.2f}x", "", "", "", ""])  # fmt: skip

    prof = await _profile(env, 2_000 if env.quick else 10_000, 3 if env.quick else 7)
    served_share = prof["get_or_load_s"] / cpu[A]
    section.tables.append([
        ["L1-hit request, in process (ASGI called directly)", "per request", "share of the request"],
        [["whole request (Starlette routing, endpoint, CachedResponses, JSON body)",
          fmt_us(prof["request_s"]), "100 %"],
         ["cache.get_or_load alone (wall, interleaved batches)", fmt_us(prof["get_or_load_s"]),
          f"{prof['timed_share']:.1%}"],
         ["get_or_load under cProfile (cumulative / Starlette.__call__)", "",
          f"{prof['profile_get_or_load_share']:.1%}"],
         ["every layered_cache frame under cProfile (own time, incl. ETag/headers)", "",
          f"{prof['profile_layered_cache_share']:.1%}"],
         ["a served request: the server's CPU per request under wrk, (a) (uvicorn, h11, the app)",
          fmt_us(cpu[A]), f"get_or_load {served_share:.1%}, the app {prof['request_s'] / cpu[A]:.0%}"]],
    ])  # fmt: skip
    by_package = sorted(prof["profile_by_package_s"].items(), key=lambda kv: -kv[1])
    section.tables.append([
        ["cProfile own time by package (same requests)", "share"],
        [[name, f"{s / prof['profile_total_s']:.1%}"] for name, s in by_package[:8]],
    ])  # fmt: skip
    section.headline.append(Headline(
        "GET /books/{id} end to end (uvicorn 1 process, wrk -c64): L1 hit / L2 hit req/s",
        f"{rps[A]:,.0f} / {rps[B]:,.0f} req/s ({rps[A] / rps[C]:.2f}x / {rps[B] / rps[C]:.2f}x no cache); "
        f"p99 {_ms(p99[A])} / {_ms(p99[B])}; server CPU {fmt_us(cpu[A])} / {fmt_us(cpu[B])} per request",
        f"no cache (20 ms DB delay) {rps[C]:,.0f} req/s, p99 {_ms(p99[C])}, CPU {fmt_us(cpu[C])}; "
        f"no delay {rps[C0]:,.0f} req/s, p99 {_ms(p99[C0])}, CPU {fmt_us(cpu[C0])}",
        "-", "info",
    ))  # fmt: skip
    section.headline.append(Headline(
        "share of an L1-hit request spent in get_or_load",
        f"{prof['timed_share']:.1%} in process ({fmt_us(prof['get_or_load_s'])} of "
        f"{fmt_us(prof['request_s'])}); {served_share:.1%} of a served one ({fmt_us(cpu[A])} server CPU)",
        f"cProfile: get_or_load {prof['profile_get_or_load_share']:.1%}, all layered_cache "
        f"{prof['profile_layered_cache_share']:.1%}",
        "-", "info",
    ))  # fmt: skip
    section.notes += [
        f"wrk -t{THREADS} -c{CONNECTIONS} -d{seconds}s --latency, a Lua script requesting "
        f"/books/1..{len(IDS)} in turn; each configuration {repeats}x, interleaved, medians. "
        "One uvicorn worker per configuration (--loop asyncio --http h11, pinned), all four started before the first run; each warmed (every id "
        "read twice, then a 1 s wrk run, discarded).",
        "The machine has 2 cores and is shared: the server process, wrk's two threads and "
        "Redis all compete for them, so these are figures for this box, not the server's "
        "ceiling; the ratios (measured in the same run, interleaved) are what to compare.",
        "Latency here is mostly queueing: 64 connections on one server process, so p50 is "
        "about 64 / requests/s (Little's law); the cheaper the request, the shorter the queue. "
        "The range column is the spread of the repeats (a busy shared machine).",
        "Counted by the server during the measured runs (GET /stats before and after): (a) "
        "must be all L1 hits, (b) L2 reads, or requests that joined the same key's L2 read "
        "already in flight (in-process single-flight: 64 connections on 16 keys), and no "
        "database join, (c) all database joins; a non-zero error column is non-2xx "
        "responses or socket errors. (a)'s few L2 reads are its L1 entries expiring "
        "(l1.ttl 30 s +- 20 %) and refilled from Redis during the run.",
        "(c) answers Cache-Control: no-store without an ETag (a cache = false namespace), "
        "(a) and (b) with the ETag and key headers: a few bytes more per response.",
        "Profile: configuration (a) in this process, the ASGI app called with a scope, "
        "receive and send (no socket, no HTTP parsing, no uvicorn): the wall share is "
        "get_or_load's median time over the whole request's, in interleaved batches "
        f"({prof['profile_requests']:,} requests per batch at most); cProfile ran "
        f"{prof['profile_requests']:,} requests ({prof['profile_l1_hits']:,} L1 hits counted) "
        "and adds its own per-call overhead to every frame, which skews the shares: the "
        "wall share is the figure, cProfile says where the rest goes. The served-request share "
        "divides get_or_load's time by (a)'s server CPU per request.",
        "Server CPU / request: the server process's user + system time (/proc/PID/stat, all "
        "its threads, SQLite's worker included) over each wrk run, divided by the requests "
        "wrk completed; median of the repeats. It is the steadier figure on a shared machine: "
        "a neighbour's burst cuts a run's requests/s, much less the CPU each request took. "
        "Redis's own CPU for (b) is not in it.",
    ]
    from bench.plots import bar_panels

    plot = bar_panels(
        {
            "requests/s (median)": {SHORT[label]: rps[label] for label in CONFIGS},
            "server CPU per request, µs (median)": {
                SHORT[label]: round(cpu[label] * 1e6, 1) for label in CONFIGS
            },
            "p99 latency, ms (median)": {
                SHORT[label]: round(p99[label] * 1000, 2) for label in CONFIGS
            },
        },
        "GET /books/{id} under wrk: (a) L1 hit, (b) L2 hit, (c) no cache, (c0) no cache, no DB delay",
        env.plot_path("e2e_wrk.png"),
        note=f"uvicorn 1 worker, wrk -t{THREADS} -c{CONNECTIONS} -d{seconds}s, 16 hot ids, "
        "SQLite in memory (c: +20 ms per query, the example's default); server, wrk and "
        "Redis share a 2-core machine.",
    )
    section.data = {
        "requests_per_s": rps, "p99_s": p99, "server_cpu_per_request_s": cpu,
        "server_cpu_runs_s": cpu_runs, "p50_s": p50, "errors": errors, "counted": counted,
        "runs": {label: [msgspec.to_builtins(r) for r in rs] for label, rs in runs.items()},
        "profile": prof,
        "plots": [plot],
    }  # fmt: skip
    section.seconds = time.perf_counter() - started
    return section
