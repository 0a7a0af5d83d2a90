"""Scenario 5: stampede across 4 OS processes x 50 concurrent requests on one cold key,
a 50 ms loader.

What, per library: loads in total (the loader INCRs a counter in Redis), the wait of
every request (p50/p99, from the shared start to its answer), the wall time of the whole
stampede against the load time, and the Redis commands each process sent (``INFO
commandstats`` delta on a Redis of our own, divided by 4; the loader's INCR and our own
INFO/CONFIG calls are excluded).

How: processes are spawned, connect and warm up, then meet at a start barrier; the
parent resets the command stats between a "ready" and a "go" barrier, so connection
set-up before the start is not counted but everything after the start is.

Why: in-process single-flight still lets every instance hit the database; the lease
makes it one load for the fleet, and waking waiters on the fill (instead of polling)
keeps both latency and Redis traffic flat.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from bench.env import BenchEnv, unique_prefix
from bench.floors import book_value, median, percentile
from bench.plots import bar_chart
from bench.report import Headline, Section

PROCESSES = 4
PER_PROCESS = 50
LOAD_S = 0.05
WALL_TARGET = 1.3
COMMANDS_TARGET = 10
_EXCLUDED = ("cmdstat_info", "cmdstat_config", "cmdstat_incr")

LIBS = {
    "plain": "plain cache-aside",
    "layered_cache": "layered_cache",
    "cashews": "cashews (lock=True)",
    "aiocache": "aiocache (cached_stampede)",
    "dogpile": "dogpile.cache (distributed_lock, threads)",
}


# -- worker side (runs in a spawned process) --------------------------------------------


def worker(lib: str, url: str, key: str, counter: str, ready: Any, go: Any, out: Any) -> None:
    try:
        if lib == "dogpile":
            out.put(_dogpile_worker(url, key, counter, ready, go))
        else:
            out.put(asyncio.run(_async_worker(lib, url, key, counter, ready, go)))
    except Exception as exc:  # report, never hang the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        ready.abort()
        go.abort()


async def _async_worker(lib: str, url: str, key: str, counter: str, ready: Any, go: Any) -> dict[str, Any]:
    import msgspec
    import redis.asyncio as aioredis

    value = book_value()
    incr_client = aioredis.Redis.from_url(url)
    await incr_client.ping()

    async def load() -> Any:
        await incr_client.incr(counter)
        await asyncio.sleep(LOAD_S)
        return value

    closers: list[Any] = [incr_client.aclose]
    if lib == "plain":
        client = aioredis.Redis.from_url(url, max_connections=PER_PROCESS + 5)
        await asyncio.gather(*(client.get(key + ":warm") for _ in range(PER_PROCESS)))
        closers.append(client.aclose)

        async def call() -> Any:
            data = await client.get(key)
            if data is not None:
                return msgspec.msgpack.decode(data)
            v = await load()
            await client.set(key, msgspec.msgpack.encode(v), ex=600)
            return v
    elif lib == "layered_cache":
        from bench.configs import make_config
        from layered_cache import LayeredCache

        cache = LayeredCache.from_config(make_config(url, key, {"book": {"key": "book:{id}"}}))
        await cache.start()
        await cache.get("book", {"id": 0})  # connect
        # start() leaves its log-only checks (memory policy, MULTI/EXEC, database:
        # ``_startup.background_checks``) running in the background; the barrier below
        # blocks this loop, so they ran after "go" and counted as stampede traffic
        # (~6 commands per process). One-time start cost: let them end first.
        await asyncio.sleep(0.5)
        closers.append(cache.close)

        async def call() -> Any:
            return await cache.get_or_load("book", {"id": 42}, load)
    elif lib == "cashews":
        from cashews import Cache

        cashews = Cache()
        cashews.setup(url, client_side=False)

        @cashews(ttl="10m", lock=True, prefix=key)
        async def book(id: int) -> Any:
            return await load()

        await cashews.get(key + ":warm")
        closers.append(cashews.close)

        async def call() -> Any:
            return await book(42)
    elif lib == "aiocache":
        from aiocache import RedisCache, cached_stampede

        parsed = urllib.parse.urlparse(url)
        deco = cached_stampede(
            lease=2, ttl=600, cache=RedisCache, endpoint=parsed.hostname, port=parsed.port,
            namespace=key, pool_max_size=PER_PROCESS + 5,
        )

        async def _book(id: int) -> Any:
            return await load()

        abook = deco(_book)
        await deco.cache.get("warm")
        closers.append(deco.cache.close)

        async def call() -> Any:
            return await abook(42)
    else:
        raise ValueError(lib)

    async def timed() -> float:
        result = await call()
        assert result is not None
        return time.time()

    ready.wait(60)
    go.wait(60)
    start = time.time()
    finishes = await asyncio.gather(*(timed() for _ in range(PER_PROCESS)))
    for close in closers:
        await close()
    return {"start": start, "finishes": list(finishes)}


def _dogpile_worker(url: str, key: str, counter: str, ready: Any, go: Any) -> dict[str, Any]:
    from dogpile.cache import make_region

    value = book_value()
    incr_client = redis.Redis.from_url(url)
    region = make_region().configure(
        "dogpile.cache.redis",
        expiration_time=600,
        arguments={"url": url, "distributed_lock": True, "thread_local_lock": False,
                   "lock_timeout": 5},
    )

    def creator() -> Any:
        incr_client.incr(counter)
        time.sleep(LOAD_S)
        return value

    def call(_: int) -> float:
        assert region.get_or_create(key + ":book:42", creator) is not None
        return time.time()

    with ThreadPoolExecutor(PER_PROCESS) as pool:
        list(pool.map(lambda _: region.get(key + ":warm"), range(PER_PROCESS)))
        ready.wait(60)
        go.wait(60)
        start = time.time()
        finishes = list(pool.map(call, range(PER_PROCESS)))
    return {"start": start, "finishes": finishes}


# -- parent side -------------------------------------------------------------------------


def _one_stampede(lib: str, url: str, admin: redis.Redis) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, go = ctx.Barrier(PROCESSES + 1), ctx.Barrier(PROCESSES + 1)
    out = ctx.Queue()
    key = unique_prefix(f"st4-{lib}")
    counter = key + "loads"
    procs = [
        ctx.Process(target=worker, args=(lib, url, key, counter, ready, go, out), daemon=True)
        for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    try:
        ready.wait(90)
        admin.config_resetstat()
        go.wait(30)
        for _ in procs:
            results.append(out.get(timeout=60))
    except Exception as exc:
        errors = [r["error"] for r in results if "error" in r]
        while not out.empty():
            errors += [r.get("error", "") for r in [out.get()]]
        return {"error": "; ".join(e for e in errors if e) or f"{type(exc).__name__}: {exc}"}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": "; ".join(errors)}
    stats = admin.info("commandstats")
    commands = {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if not name.startswith(_EXCLUDED)
    }
    start = min(r["start"] for r in results)
    waits = [f - r["start"] for r in results for f in r["finishes"]]
    return {
        "loads": int(admin.get(counter) or 0),
        "waits": waits,
        "wall": max(f for r in results for f in r["finishes"]) - start,
        "commands": commands,
        "commands_per_process": sum(commands.values()) / PROCESSES,
    }


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section(
        "stampede_procs", "5. Stampede across 4 processes x 50 concurrent, cold key, 50 ms loader"
    )
    server = env.own_redis()
    admin = server.client(decode_responses=True)
    repeats = 1 if env.quick else 3
    runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in LIBS}
    for lib in LIBS:
        for _ in range(repeats if lib in ("layered_cache", "plain") else 1):
            result = await asyncio.to_thread(_one_stampede, lib, server.url, admin)
            runs[lib].append(result)
            if "error" in result:
                break
    section.columns = [
        "library", "loads (max of runs)", "wait p50", "wait p99", "wall", "wall / load",
        "Redis commands / process",
    ]
    summary: dict[str, dict[str, Any]] = {}
    for lib, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            err = results[0]["error"] if results else "not run"
            section.rows.append([LIBS[lib], f"n/a ({err[:80]})", "", "", "", "", ""])
            continue
        walls = [r["wall"] for r in ok]
        s = {
            "loads": max(r["loads"] for r in ok),
            "p50": median([percentile(r["waits"], 50) for r in ok]),
            "p99": median([percentile(r["waits"], 99) for r in ok]),
            "wall": median(walls),
            "commands_per_process": median([r["commands_per_process"] for r in ok]),
            "commands": ok[len(ok) // 2]["commands"],
            "runs": len(ok),
        }
        summary[lib] = s
        section.rows.append([
            LIBS[lib], str(s["loads"]), f"{s['p50'] * 1000:.0f} ms", f"{s['p99'] * 1000:.0f} ms",
            f"{s['wall'] * 1000:.0f} ms", f"{s['wall'] / LOAD_S:.2f}x",
            f"{s['commands_per_process']:.1f}",
        ])
    for lib, s in summary.items():
        top = sorted(s["commands"].items(), key=lambda kv: -kv[1])
        section.notes.append(
            f"{LIBS[lib]} commands (all 4 processes): " + ", ".join(f"{k} {v}" for k, v in top)
        )
    section.notes.append(
        f"layered_cache and plain: median of {repeats} runs; peers: 1 run. Waits are measured "
        "from each process's start (after the shared barrier) to the answer."
    )
    plot = bar_chart(
        {LIBS[lib].split(" (")[0]: float(s["loads"]) for lib, s in summary.items()},
        "Loads per stampede, 4 processes x 50 (cold key)", "loader calls (log)",
        env.plot_path("stampede_4proc_loads.png"), log=True,
    )
    section.data = {"summary": summary, "runs": runs, "plots": [plot]}
    ours = summary.get("layered_cache")
    if ours:
        wall_ratio = ours["wall"] / LOAD_S
        section.headline += [
            Headline(
                "Stampede, 4 processes x 50: loads",
                str(ours["loads"]),
                "plain " + (str(summary["plain"]["loads"]) if "plain" in summary else "n/a"),
                "1",
                "ok" if ours["loads"] == 1 else "MISSED",
            ),
            Headline(
                "Stampede, 4 processes x 50: wall / load time (p50, p99 wait)",
                f"{wall_ratio:.2f}x (p50 {ours['p50'] * 1000:.0f} ms, p99 {ours['p99'] * 1000:.0f} ms)",
                "; ".join(
                    f"{LIBS[k].split(' (')[0]} {v['wall'] / LOAD_S:.1f}x"
                    for k, v in summary.items() if k != "layered_cache"
                ),
                f"<= {WALL_TARGET}x",
                "ok" if wall_ratio <= WALL_TARGET else "MISSED",
            ),
            Headline(
                "Stampede, 4 processes x 50: Redis commands per process",
                f"{ours['commands_per_process']:.1f}",
                "; ".join(
                    f"{LIBS[k].split(' (')[0]} {v['commands_per_process']:.0f}"
                    for k, v in summary.items() if k != "layered_cache"
                ),
                f"<= {COMMANDS_TARGET}",
                "ok" if ours["commands_per_process"] <= COMMANDS_TARGET else "MISSED",
            ),
        ]
    else:
        section.headline.append(Headline("Stampede, 4 processes x 50", "n/a", "", "1 load", "n/a"))
    admin.close()
    section.seconds = time.perf_counter() - started
    return section
