"""The servers the scenarios run against, and the machine description for the report.

A shared Redis comes from ``REDIS_URL`` when it is reachable (``make bench`` sets it),
else a throwaway ``redis-server`` is started. Scenarios that count commands with
``INFO commandstats`` always get a Redis of their own, so nothing else pollutes the
counts. The 3-master cluster and the Kafka-protocol broker are started on first use.
Everything started here is stopped by :meth:`BenchEnv.close`.

Every scenario's keys carry a ``bench-`` prefix (``unique_prefix``), and the runner
deletes them from the shared Redis before the first scenario and after each one
(``forget_keys``): the ``sets`` scenario alone writes ~300,000 values of ~1 KB, and a
Redis grown by earlier scenarios or runs made later writes measurably slower (a
set_many of 100 went from 1.08x to 1.39x its floor on a Redis left at 520 MB).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.report import RESULTS
from tests.servers import KafkaBroker, RedisClusterServers, RedisServer, redis_reachable

__all__ = ["BenchEnv", "machine_info", "unique_prefix"]


def unique_prefix(name: str) -> str:
    return f"bench-{name}-{uuid.uuid4().hex[:6]}:"


class BenchEnv:
    def __init__(self, quick: bool, write: bool = True) -> None:
        self.quick = quick
        # Where the plots go: bench/results/ with the report, or, for a run that writes
        # no results (``--no-write``), a scratch directory: the committed plots stay.
        self.plots = RESULTS if write else Path(tempfile.mkdtemp(prefix="bench-plots-"))
        self._started: list[Any] = []
        self._redis_url: str | None = None
        self._cluster: RedisClusterServers | None = None
        self._kafka: KafkaBroker | None = None

    def redis_url(self) -> str:
        """A Redis shared by the scenarios (keys carry a unique prefix)."""
        if self._redis_url is None:
            env = os.environ.get("REDIS_URL", "")
            if env and redis_reachable(env):
                self._redis_url = env
            else:
                self._redis_url = self.own_redis().url
        return self._redis_url

    def forget_keys(self) -> int:
        """Delete every ``bench-`` key from the shared Redis (if one is in use); returns
        how many. Outside any timing: between scenarios."""
        import redis

        url = self._redis_url or os.environ.get("REDIS_URL", "")
        if not url or not redis_reachable(url):
            return 0
        deleted = 0
        with redis.Redis.from_url(url) as client:
            batch: list[bytes] = []
            for name in client.scan_iter(match="bench-*", count=10_000):
                batch.append(name)
                if len(batch) == 10_000:
                    deleted += client.unlink(*batch)
                    batch = []
            if batch:
                deleted += client.unlink(*batch)
        return deleted

    def own_redis(self) -> RedisServer:
        """A fresh Redis nobody else uses: for command counting."""
        server = RedisServer().start()
        self._started.append(server)
        return server

    def cluster(self) -> RedisClusterServers:
        if self._cluster is None:
            self._cluster = RedisClusterServers(3).start()
            self._started.append(self._cluster)
        return self._cluster

    def kafka(self) -> KafkaBroker:
        if self._kafka is None:
            self._kafka = KafkaBroker().start()
            self._started.append(self._kafka)
        return self._kafka

    def plot_path(self, name: str) -> Path:
        return self.plots / name

    def close(self) -> None:
        for server in reversed(self._started):
            with contextlib.suppress(Exception):
                server.stop() if isinstance(server, RedisClusterServers) else server.close()
        self._started.clear()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _redis_server_version() -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=5)
        for part in out.stdout.split():
            if part.startswith("v="):
                return part[2:]
    return "unknown"


def machine_info() -> dict[str, Any]:
    """Date, machine (nproc, CPU model, Python) and the versions of everything measured."""
    import layered_cache

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "load_average_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "redis_server": _redis_server_version(),
        "versions": {
            "layered_cache": layered_cache.__version__,
            "cachetools": _version("cachetools"),
            "redis-py": _version("redis"),
            "hiredis": _version("hiredis"),  # redis-py parses replies with it if installed
            "msgspec": _version("msgspec"),
            "cashews": _version("cashews"),
            "aiocache": _version("aiocache"),
            "dogpile.cache": _version("dogpile.cache"),
            "aiokafka": _version("aiokafka"),
            "matplotlib": _version("matplotlib"),
        },
    }
