"""``make demo`` step B7 (optional): the bookstore behind a real Varnish.

Runs only where ``varnishd`` is installed (``make test`` installs it with apt:
deploy/local/ensure-varnish.sh). A third instance, G, purges Varnish on change
(``[purge] urls``); Varnish runs deploy/varnish/default.vcl pointed at G. Shows the
gateway's hit, a 304 for an unchanged book, and a price change reaching the gateway's
copy through the purge instead of after ``s-maxage`` (30 s). docs/http.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import msgspec

from examples.bookstore.app import BookstoreSettings, create_app, serve
from examples.bookstore.db import SQLiteDatabase
from layered_cache import Config

VCL = Path(__file__).parent.parent / "deploy" / "varnish" / "default.vcl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def varnishd() -> str | None:
    return shutil.which("varnishd") or next(
        (p for p in ("/usr/sbin/varnishd", "/usr/local/sbin/varnishd") if Path(p).exists()), None
    )


def _launch(binary: str, backend_port: int, workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    Path(workdir).chmod(0o755)  # varnishd's workers run as an unprivileged user
    vcl = Path(workdir) / "default.vcl"
    vcl.write_text(VCL.read_text().replace('.port = "8000";', f'.port = "{backend_port}";'))
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "-F", "-a", f"127.0.0.1:{port}", "-f", str(vcl), "-n", f"{workdir}/n",
         "-s", "malloc,32m", "-p", "ban_lurker_sleep=0.01"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def varnish(binary: str, backend_port: int) -> AsyncIterator[str]:
    """``varnishd -F`` on a free port in front of ``backend_port``; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="demo-varnish-") as workdir:
        proc, url = await asyncio.to_thread(_launch, binary, backend_port, workdir)
        try:
            async with httpx.AsyncClient(timeout=1) as probe:
                for _ in range(300):  # ready once the VCL answers a bare BAN itself (400)
                    with contextlib.suppress(httpx.HTTPError):
                        if (await probe.request("BAN", url + "/")).status_code == 400:
                            break
                    await asyncio.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, 10)


async def gateway_step(
    config: Config,
    db: SQLiteDatabase,
    row: Callable[..., None],
    check: Callable[[bool, str], str],
    ms: Callable[[float], str],
) -> None:
    print("\nB7. Gateway: Varnish in front of a third instance G (purges on change)")
    binary = varnishd()
    if binary is None:
        print("  skipped: varnishd is not installed (deploy/local/ensure-varnish.sh installs it)")
        return
    port = _free_port()
    async with varnish(binary, port) as edge_url:
        purge = msgspec.structs.replace(config.purge, urls=[edge_url])
        settings = BookstoreSettings(
            config=msgspec.structs.replace(config, purge=purge), db=db, produce_events=False,
            name="G",
        )  # fmt: skip
        async with (
            serve(create_app(settings), port=port) as base,
            httpx.AsyncClient(base_url=base, timeout=10) as g,
            httpx.AsyncClient(base_url=edge_url, timeout=10) as edge,
        ):
            first, again = await edge.get("/books/7"), await edge.get("/books/7")
            row("GET /books/7 through Varnish, twice", f"{first.headers.get('x-cache')}, "
                f"{again.headers.get('x-cache')}", check(again.headers.get("x-cache") == "HIT",
                                                           "B7: the gateway keeps it"))  # fmt: skip
            print(f"    Cache-Control: {first.headers['cache-control']}; ETag {first.headers['etag']}")
            etag = first.headers["etag"]
            unchanged = await edge.get("/books/7", headers={"If-None-Match": etag})
            row("same request with If-None-Match", str(unchanged.status_code),
                check(unchanged.status_code == 304, "B7: 304 for an unchanged book"))  # fmt: skip
            price = "7.77" if first.json()["price"] != "7.77" else "6.66"
            await g.put("/books/7/price", json={"price": price})
            started = time.perf_counter()
            while (await edge.get("/books/7")).json()["price"] != price:
                if time.perf_counter() - started > 10:
                    break
                await asyncio.sleep(0.005)
            took = time.perf_counter() - started
            row(f"price -> {price}: the gateway serves it after", ms(took),
                check(took < 1.0, "B7: the purge reaches the gateway < 1 s (s-maxage is 30 s)"))  # fmt: skip
