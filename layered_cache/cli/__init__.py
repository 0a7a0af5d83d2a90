"""``layered-cache`` (also ``python -m layered_cache``): look inside and operate the cache.

    layered-cache config check FILE [--json]
    layered-cache inspect NAMESPACE field=value ... --config FILE [--json]
    layered-cache invalidate NAMESPACE field=value ... --config FILE
    layered-cache hotkeys --config FILE [--json]
    layered-cache doctor --config FILE [--json]
    layered-cache warm NAMESPACE --from FILE.jsonl --config FILE [--concurrency N]
                       [--start-line K]
    layered-cache daemon --config FILE [--log-format json|console] [--health-port N]

There is no ``bench`` command: the benchmarks live in ``bench/`` of a source checkout,
which the wheel does not ship (``make bench`` runs them there).

Bad input (config, unknown namespace, missing/unknown/unsafe field, unreadable file,
unreachable Redis) prints ``layered-cache: error: ...`` on stderr and exits with 2,
without a traceback. Passwords in URLs are never printed. Output into a pipe that closed
early (``| head -1``) ends the command quietly with 141, as a process killed by SIGPIPE
would. See docs/cli.md.

One module per command group (``config_check``, ``inspect_key``, ``invalidate``,
``hotkeys``, ``doctor``, ``warm``, ``daemon``), each with its typed report; ``parser`` holds the
command line, ``common``, ``connect`` and ``reads`` (key reads through the store and its
breaker) what the commands share.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from layered_cache._logs import configure_logging
from layered_cache._redact import redact
from layered_cache.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    CliError,
    load,
    parse_fields,
)
from layered_cache.cli.parser import Handler, build_parser

__all__ = ["CliError", "build_parser", "main", "parse_fields"]


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: the exit code of the command (``argv`` defaults to sys.argv).

    A reader that goes away (``layered-cache config check FILE | head -1``) is not an
    error of the command: the way the Python docs recommend (signal module, "Note on
    SIGPIPE"), the ``BrokenPipeError`` is caught here, stdout is pointed at devnull so
    the interpreter's final flush can't fail again, and the exit is quiet."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    return code


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a test's capture): nothing to flush
        pass


def _main(argv: Sequence[str] | None) -> int:
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
