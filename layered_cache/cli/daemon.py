"""``layered-cache daemon --config FILE [--log-format json|console] [--health-port N]``:
run the Kafka invalidation daemon in the foreground (docs/daemon.md).

Only a launcher: the daemon lives in ``layered_cache.daemon`` and is imported when this
command runs, so the other commands never load aiokafka.
"""

from __future__ import annotations

import argparse
from typing import TextIO

__all__ = ["cmd_daemon"]


def cmd_daemon(args: argparse.Namespace, out: TextIO) -> int:
    """Runs until SIGTERM/SIGINT (exit 0); a config error or a taken port exits 2."""
    from layered_cache.daemon.main import run  # on use: the daemon's extra may be missing

    # ``daemon_config``, not ``config``: main() would otherwise set logging up from the
    # file before the daemon applies --log-format; the daemon sets its own logging up.
    args.config = args.daemon_config
    return run(args)
