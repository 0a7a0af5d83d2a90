"""``python -m consumers --config layered_cache.toml``: run the invalidation daemon.

SIGTERM / SIGINT finish the batch in flight, commit it, leave the consumer group and
exit 0; a config error exits 2 with the file, path and problem.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog

from consumers.daemon import Daemon
from consumers.logs import configure_logging
from layered_cache.config import ConfigError, load_config
from layered_cache.redact import redact


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m consumers", description="Kafka -> cache invalidation daemon"
    )
    parser.add_argument("--config", required=True, help="layered_cache TOML file")
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default="json",
        help="json (default: one object per line, for log shippers) or console",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="override kafka.health_port (0 = ephemeral, -1 = off)",
    )
    return parser.parse_args(argv)


async def _serve(daemon: Daemon) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    await daemon.run()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"config error: {redact(str(exc))}", file=sys.stderr)
        return 2
    configure_logging(config.logging.level, args.log_format)
    try:
        daemon = Daemon(config, health_port=args.health_port)
    except (KeyError, ValueError) as exc:
        print(f"config error: {redact(str(exc))}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(daemon))
    except Exception:
        structlog.get_logger("consumers").exception("daemon_crashed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
