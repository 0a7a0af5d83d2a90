"""``layered-cache`` (also ``python -m layered_cache``): look inside and operate the cache.

    layered-cache config check FILE [--json]
    layered-cache inspect NAMESPACE field=value ... --config FILE [--json]
    layered-cache invalidate NAMESPACE field=value ... --config FILE
    layered-cache hotkeys --config FILE [--json]
    layered-cache warm NAMESPACE --from FILE.jsonl --config FILE [--concurrency N]
                       [--start-line K]
    layered-cache daemon --config FILE [--log-format json|console] [--health-port N]

There is no ``bench`` command: the benchmarks live in ``bench/`` of a source checkout,
which the wheel does not ship (``make bench`` runs them there).

Bad input (config, unknown namespace, missing/unknown/unsafe field, unreadable file,
unreachable Redis) prints ``layered-cache: error: ...`` on stderr and exits with 2,
without a traceback. Passwords in URLs are never printed. See docs/cli.md.

One module per command group (``config_check``, ``inspect_key``, ``invalidate``,
``hotkeys``, ``warm``, ``daemon``), each with its typed report; ``parser`` holds the
command line, ``common``, ``connect`` and ``reads`` (key reads through the store and its
breaker) what the commands share.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from layered_cache._logs import configure_logging
from layered_cache._redact import redact
from layered_cache.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, CliError, load, parse_fields
from layered_cache.cli.parser import Handler, build_parser

__all__ = ["CliError", "build_parser", "main", "parse_fields"]


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: the exit code of the command (``argv`` defaults to sys.argv)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config_path = getattr(args, "config", None)
    try:
        if config_path is not None:
            # Library warnings (breaker, fallbacks) go to stderr in the configured format.
            configure_logging(load(config_path).logging)
        handler: Handler = args.handler
        return handler(args, sys.stdout)
    except CliError as exc:
        print(f"layered-cache: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as exc:  # e.g. an unknown logging format
        print(f"layered-cache: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
