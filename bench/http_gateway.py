"""Scenario 16: the bookstore behind a real Varnish (deploy/varnish/default.vcl).

Freshness, what: ``PUT /books/8/price`` straight to the app (which updates the database
and calls ``invalidate`` / ``invalidate_tag``), then ``GET /books/8`` through Varnish
every 2 ms until the new price shows; the time from the PUT's return to the first fresh
read. With ``[purge] urls`` (the app purges Varnish by key and tag) and ``s_maxage``
30 s; and without purging, ``s_maxage`` 2 s, the change made at a random moment of the
copy's life (so the figure is spread over 0..2 s, the bound being 2 s).

Throughput, what: ``wrk`` (2 threads, 32 connections, 5 s) on ``GET /books/42`` through
Varnish (every request a hit) and straight to the app (an L1 hit, rendered by Starlette
under uvicorn, one process): what the gateway layer buys.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from bench.env import BenchEnv, unique_prefix
from bench.floors import median, percentile
from bench.report import Headline, Section

P99_TARGET = 0.100  # the invalidation promise of the inner layers


@asynccontextmanager
async def _gateway(env: BenchEnv, s_maxage: float, purge: bool) -> AsyncIterator[Any]:
    import httpx
    import msgspec

    from examples.bookstore.app import BookstoreSettings, create_app, load_bookstore_config, serve
    from examples.bookstore.db import SQLiteDatabase
    from layered_cache._config import Duration, HttpConfig
    from tests.servers import free_port
    from tests.varnish_server import VarnishServer

    port = free_port()
    varnish = VarnishServer(port)
    config = load_bookstore_config(
        redis_url=env.redis_url(), prefix=unique_prefix("http"), env={},
        overrides={"logging": {"level": "error"},
                   # no repeat: a round's late second purge would cut a later round short
                   "purge": {"urls": [varnish.url] if purge else [], "repeat_after": "0s"}},
    )  # fmt: skip
    book = msgspec.structs.replace(
        config.namespaces["book"], http=HttpConfig(s_maxage=Duration(s_maxage))
    )
    config = msgspec.structs.replace(config, namespaces={**config.namespaces, "book": book})
    db = SQLiteDatabase(":memory:", books=100, query_delay=0.005)
    await db.open()
    await asyncio.to_thread(varnish.start, 60)
    try:
        app = create_app(BookstoreSettings(config=config, db=db, produce_events=False))
        async with (
            serve(app, port=port) as base,
            httpx.AsyncClient(base_url=base, timeout=10) as direct,
            httpx.AsyncClient(base_url=varnish.url, timeout=10) as edge,
        ):
            yield direct, edge, varnish
    finally:
        varnish.close()
        await db.close()


async def _until_fresh(edge: Any, price: str) -> float:
    started = time.perf_counter()
    while (await edge.get("/books/8")).json()["price"] != price:
        await asyncio.sleep(0.002)
    return time.perf_counter() - started


async def _freshness(env: BenchEnv, rounds: int, purge: bool) -> list[float]:
    s_maxage = 30.0 if purge else 2.0
    took: list[float] = []
    async with _gateway(env, s_maxage, purge) as (direct, edge, _):
        for i in range(rounds):
            await edge.get("/books/8")  # Varnish holds the current price
            if not purge:
                await asyncio.sleep(random.uniform(0, s_maxage))  # a random moment of its life
            price = f"{30 + i}.{i % 100:02d}"
            await direct.put("/books/8/price", json={"price": price})
            took.append(await asyncio.wait_for(_until_fresh(edge, price), s_maxage + 30))
    return took


async def _wrk(url: str, seconds: int) -> float:
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t2", "-c32", f"-d{seconds}s", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    match = re.search(r"Requests/sec:\s+([\d.]+)", out.decode())
    if match is None:
        raise RuntimeError(f"wrk printed no Requests/sec: {out.decode()[-300:]}")
    return float(match.group(1))


async def _throughput(env: BenchEnv, seconds: int) -> dict[str, float]:
    async with _gateway(env, 30.0, False) as (direct, edge, varnish):
        await edge.get("/books/42")  # warm both: L1 and Varnish hold it
        return {
            "varnish": await _wrk(f"{varnish.url}/books/42", seconds),
            "direct": await _wrk(str(direct.base_url).rstrip("/") + "/books/42", seconds),
        }


def _ms(value: float) -> str:
    return f"{value * 1000:.1f} ms"


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("http_gateway", "16. HTTP gateway (Varnish): freshness with and without purge; requests/s")
    from tests.varnish_server import varnishd_binary

    if varnishd_binary() is None:
        section.error = "varnishd not installed (apt-get install varnish)"
        return section
    rounds, slow_rounds = (20, 5) if env.quick else (100, 20)
    purged = await _freshness(env, rounds, purge=True)
    unpurged = await _freshness(env, slow_rounds, purge=False)
    section.columns = ["price change -> fresh at the gateway", "p50", "p99", "max", "rounds"]
    for label, took in (("with purge (s_maxage 30 s)", purged),
                        ("without purge (s_maxage 2 s)", unpurged)):  # fmt: skip
        section.rows.append([label, _ms(median(took)), _ms(percentile(took, 99)),
                             _ms(max(took)), str(len(took))])  # fmt: skip
    data: dict[str, Any] = {"purged_s": purged, "unpurged_s": unpurged}
    section.headline.append(Headline(
        "price change -> gateway copy fresh, with purge (p99)",
        f"{_ms(percentile(purged, 99))} (p50 {_ms(median(purged))})",
        f"without purge: p99 {_ms(percentile(unpurged, 99))} (bound s_maxage 2 s)",
        f"p99 <= {P99_TARGET * 1000:.0f} ms",
        "ok" if percentile(purged, 99) <= P99_TARGET else "MISSED",
    ))  # fmt: skip
    if shutil.which("wrk"):
        rps = await _throughput(env, 3 if env.quick else 5)
        section.tables.append([["GET /books/42 (wrk -t2 -c32)", "requests/s"],
                               [["through Varnish (hits)", f"{rps['varnish']:,.0f}"],
                                ["straight to the app (L1 hits)", f"{rps['direct']:,.0f}"]]])  # fmt: skip
        data["rps"] = rps
        section.headline.append(Headline(
            "GET /books/42 through Varnish vs direct (wrk)",
            f"{rps['varnish']:,.0f} req/s", f"direct {rps['direct']:,.0f} req/s", "-", "info",
        ))  # fmt: skip
    else:
        section.notes.append("wrk not installed (apt-get install wrk): no requests/s")
    section.notes.append(
        "One process runs the app (uvicorn, SQLite in memory) and the polling client; Varnish "
        "and wrk are their own processes, all on this machine. Freshness is timed from the "
        "PUT's return; the gateway is polled every 2 ms."
    )
    section.data = data
    section.seconds = time.perf_counter() - started
    return section
