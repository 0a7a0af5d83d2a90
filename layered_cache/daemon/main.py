"""``layered-cache daemon --config layered_cache.toml``: run the invalidation daemon.

(Also ``python -m layered_cache.daemon``, and ``python -m consumers`` inside the source
repository.) SIGTERM / SIGINT finish the batch in flight, commit it, leave the consumer
group and exit 0; a config error, a health port that is already taken, or the
``daemon`` extra not installed, exits 2 with one line on stderr.

This module imports without the extra (the daemon itself is imported in ``run``), so
that ``layered-cache daemon`` can say what to install instead of printing a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import structlog

from layered_cache._config import Config, ConfigError, load_config
from layered_cache._extras import missing_extra
from layered_cache._invalidation import ReplicaCountMismatch
from layered_cache._logs import FORMAT_ENV, configure_logging
from layered_cache._redact import redact

if TYPE_CHECKING:
    from layered_cache.daemon.core import Daemon

__all__ = ["build_parser", "main"]

EXIT_ERROR = 2


def build_parser(prog: str = "layered-cache daemon") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Kafka -> cache invalidation daemon")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE", help="layered_cache TOML file")
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default=None,
        help="override logging.format (and LAYERED_CACHE_LOG_FORMAT)",
    )
    parser.add_argument(
        "--health-port",
        type=_port,
        default=None,
        help="override kafka.health_port (0 = ephemeral, -1 = off)",
    )


def _port(text: str) -> int:
    """``--health-port``: the config's bounds (-1 off, 0 ephemeral, up to 65535)."""
    port = int(text)
    if not -1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be -1 (off), 0 (any) or up to 65535, got {port}")
    return port


def setup_logging(config: Config, log_format: str | None) -> None:
    """The config's ``logging`` table and the LAYERED_CACHE_LOG_* overrides, on stdout
    (``--log-format`` wins over both)."""
    logging_config = config.logging
    env: dict[str, str] = dict(os.environ)
    if log_format is not None:
        logging_config = msgspec.structs.replace(logging_config, format=log_format)
        env.pop(FORMAT_ENV, None)
    configure_logging(logging_config, stream=sys.stdout, env=env, force=True)
    # aiokafka's INFO lines (group joins, fetch positions) are noise at the daemon's INFO.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))


async def _serve(daemon: Daemon) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    await daemon.run()


def _error(prog: str, message: str) -> int:
    print(f"{prog}: error: {redact(message)}", file=sys.stderr)
    return EXIT_ERROR


def run(args: argparse.Namespace, prog: str = "layered-cache daemon") -> int:
    try:
        from layered_cache.daemon.core import Daemon, DaemonStartError
    except ImportError as exc:
        error = missing_extra("the daemon", "daemon", exc)
        if error is exc:
            raise  # not a missing extra: a broken install deserves its traceback
        return _error(prog, str(error))
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _error(prog, f"config error: {exc}")
    try:
        setup_logging(config, args.log_format)
        daemon = Daemon(config, health_port=args.health_port)
    except (KeyError, ValueError) as exc:
        return _error(prog, f"config error: {exc}")
    try:
        asyncio.run(_serve(daemon))
    except (DaemonStartError, ReplicaCountMismatch) as exc:
        return _error(prog, str(exc))
    except Exception:
        structlog.get_logger("layered_cache.daemon").exception("daemon_crashed")
        return 1
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "layered-cache daemon") -> int:
    args = build_parser(prog).parse_args(argv)
    return run(args, prog)
