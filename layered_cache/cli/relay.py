"""``layered-cache relay --config FILE [--listen HOST:PORT] [--upstream URL] [--keep N]``:
run a backplane relay in the foreground (docs/operations.md, "Fan-out").

Instances whose config says ``backplane.relay = "redis://HOST:PORT"`` read the
backplane stream through it; the relay follows the stream on the config's Redis (or on
another relay: ``--upstream``, for a tree). It runs until SIGTERM or SIGINT (exit 0),
logging its counters every ``--status-every`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import time
from collections.abc import Coroutine
from typing import Any, TextIO

import msgspec
import structlog

from layered_cache._config import Config
from layered_cache._config.checks import host_and_port, is_number, relay_url_problem
from layered_cache._keys import backplane_stream_name
from layered_cache._redisclock import RedisClock
from layered_cache._relay import Relay
from layered_cache._relay_upstream import Upstream
from layered_cache.cli.common import CliError, load

__all__ = ["cmd_relay"]

_log = structlog.get_logger("layered_cache.relay")


def cmd_relay(args: argparse.Namespace, out: TextIO) -> int:
    config = load(args.config)
    host, port = _address(args.listen)
    if args.keep < 1:
        raise CliError(f"--keep must be at least 1, got {args.keep}")
    if not 0 < args.status_every < math.inf:  # 0 or NaN logged status in a tight loop
        raise CliError(f"--status-every must be positive seconds, got {args.status_every}")
    if args.upstream is not None and (problem := relay_url_problem(args.upstream)):
        raise CliError(f"--upstream: {problem}")
    return asyncio.run(_run(config, host, port, args, out))


def _address(listen: str) -> tuple[str, int]:
    host, port = host_and_port(listen)
    if not host or not is_number(port) or int(port) > 65535:
        raise CliError(f"--listen must be HOST:PORT, got {listen!r}")
    return host, int(port)


async def _run(config: Config, host: str, port: int, args: argparse.Namespace, out: TextIO) -> int:
    stream = backplane_stream_name(config.redis.prefix, config.backplane.stream)
    block = config.backplane.block
    upstream = Upstream(config.redis, stream, block, url=args.upstream)
    # Stream IDs are Redis's clock: the relay judges its position against Redis's time as
    # measured over its upstream, as an instance does (docs/operations.md, "Clocks").
    wait = config.redis.connect_timeout + config.redis.timeout
    clock = RedisClock(time.time, upstream.time, timeout=wait)
    relay = Relay(
        upstream, stream, clock=clock.now, block=block, keep=args.keep,
        maxlen=config.backplane.maxlen,
    )
    # SIGTERM/SIGINT from the start: one during the clock's first samples (an upstream
    # that hangs) killed the process by the signal, with no clean close.
    stop = _stop_on_signals()
    try:
        bound_host, bound_port = await _listen(relay, host, port)
        # Unsynced after ``wait``: this host's clock, as a cache's. Or stopped meanwhile.
        await _first_of(clock.start(wait), stop.wait())
        if not stop.is_set():
            # One line on stdout for whoever started us (a test, a supervisor's log).
            address = f"{bound_host}:{bound_port}"
            print(f"relay listening on {address}, following {stream}", file=out, flush=True)
            await _until_stopped(relay, stop, args.status_every)
    finally:
        await clock.stop()  # first: a sample after relay.close() would connect again
        await relay.close()
    return 0


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _first_of(*steps: Coroutine[Any, Any, Any]) -> None:
    """Run ``steps`` until one ends; the others are cancelled."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


async def _listen(relay: Relay, host: str, port: int) -> tuple[str, int]:
    """The port first: a taken one is the one line on stderr, before anything is logged."""
    try:
        return await relay.start(host, port)
    except OSError as exc:
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


async def _until_stopped(relay: Relay, stop: asyncio.Event, status_every: float) -> None:
    """Log the relay's counters every ``status_every`` seconds until SIGTERM or SIGINT."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), status_every)
        except TimeoutError:
            _log.info("relay_status", **msgspec.structs.asdict(relay.status()))
