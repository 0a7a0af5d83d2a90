"""Run ``wrk --latency`` and read its summary: requests/s, latency percentiles, errors.

wrk (Debian package ``wrk``) is an HTTP load generator in C: its own threads and
connections, so the server, not the client, is what limits the rate (on a shared
2-core machine both still compete for the cores).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from pathlib import Path

import msgspec

__all__ = ["WrkResult", "parse_wrk", "round_robin_script", "run_wrk"]

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class WrkResult(msgspec.Struct, frozen=True):
    requests_per_s: float
    requests: int
    latency_s: dict[str, float]  # "50%", "75%", "90%", "99%" -> seconds
    non_2xx: int = 0  # "Non-2xx or 3xx responses"
    socket_errors: int = 0  # connect + read + write + timeout

    @property
    def p99_s(self) -> float:
        return self.latency_s["99%"]


def _seconds(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(output: str) -> WrkResult:
    """The summary wrk prints with ``--latency``; raises ValueError naming what is
    missing (wrk prints only an error line when it can't connect)."""
    rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    total = re.search(r"^\s*(\d+) requests in ", output, re.M)
    latency = dict(re.findall(r"^\s+(\d+(?:\.\d+)?%)\s+([\d.]+(?:us|ms|s|m|h))\s*$", output, re.M))
    if rate is None or total is None or "99%" not in latency:
        raise ValueError(f"wrk printed no rate or latency distribution: {output[-400:]!r}")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    return WrkResult(
        requests_per_s=float(rate.group(1)),
        requests=int(total.group(1)),
        latency_s={pct: _seconds(value) for pct, value in latency.items()},
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=sum(int(n) for n in errors.groups()) if errors else 0,
    )


def round_robin_script(paths: list[str]) -> str:
    """A wrk Lua script requesting ``paths`` in turn (per thread), so a run reads a
    fixed set of keys rather than one."""
    items = ", ".join(f'"{path}"' for path in paths)
    return (
        f"local paths = {{{items}}}\n"
        "local i = 0\n"
        "request = function()\n"
        "  i = i % #paths + 1\n"
        '  return wrk.format("GET", paths[i])\n'
        "end\n"
    )


async def run_wrk(
    base_url: str, paths: list[str], seconds: float, threads: int = 2, connections: int = 32
) -> WrkResult:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "paths.lua"
        script.write_text(round_robin_script(paths))
        proc = await asyncio.create_subprocess_exec(
            "wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency",
            "-s", str(script), base_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
    return parse_wrk(out.decode(errors="replace"))
