"""``layered-cache warm NAMESPACE --from FILE.jsonl --config FILE [--concurrency N]
[--start-line K]``: bulk fill a namespace through ``cache.set``.

The streaming, the bounded concurrency and the resume line are ``layered_cache._warm``'s;
this module turns its ``WarmReport`` into the summary, the failure list and the exit
code, and routes Ctrl-C to the warmer so it can stop with a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import BinaryIO, TextIO

import msgspec

from layered_cache._config import Config
from layered_cache._redact import redact
from layered_cache._warm import (
    STOPPED_BY_SIGINT,
    JsonlReader,
    Progress,
    Warmer,
    WarmReport,
    file_size,
)
from layered_cache.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PARTIAL,
    CliError,
    load,
    policy_of,
    run,
)
from layered_cache.cli.connect import connected, same_replica_counts

__all__ = ["WarmArgs", "cmd_warm"]


class WarmArgs(msgspec.Struct, frozen=True):
    """The command line of one run, checked (``--concurrency`` and ``--start-line`` >= 1)."""

    namespace: str
    path: str
    concurrency: int
    start_line: int


def _without_l1(config: Config) -> Config:
    """The config with every L1 off: a CLI process exits right after warming, so an L1
    copy of each value would only cost memory (up to ``max_entries`` values)."""
    namespaces = {
        name: msgspec.structs.replace(ns, l1=False) for name, ns in config.namespaces.items()
    }
    return msgspec.structs.replace(config, namespaces=namespaces)


async def _warm(config: Config, args: WarmArgs, source: BinaryIO, stream: TextIO) -> WarmReport:
    async with connected(_without_l1(config), "warm") as session:
        await same_replica_counts(session, config)
        policy = policy_of(session.cache, args.namespace)
        if not policy.cache or not policy.l2:
            raise CliError(
                f"namespace {args.namespace!r} has no L2 (cache or l2 is off): nothing to warm"
            )
        reader = JsonlReader(source, policy, args.start_line)
        progress = Progress(file_size(source), f"warm {args.namespace}", stream)
        warmer = Warmer(session.cache, policy, reader, args.concurrency, progress)
        with _on_sigint(warmer.interrupt):
            return await warmer.run()


@contextlib.contextmanager
def _on_sigint(handler: Callable[[], None]) -> Iterator[None]:
    """Route SIGINT to ``handler`` inside the loop instead of raising KeyboardInterrupt
    into whichever task happens to run (which loses the summary and leaves tasks whose
    exception nobody retrieves)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _warm_summary(report: WarmReport, args: WarmArgs, out: TextIO) -> None:
    read = "read so far" if report.stopped_by is not None else ""
    line = f"warmed {report.warmed} of {report.read} {args.namespace} entries {read}".rstrip()
    if report.failed:
        line += f"; {report.failed} failed"
    if report.not_cached:
        line += f"; {report.not_cached} not cached by set() (see the log)"
    out.write(line + "\n")
    if report.resume_line is not None:
        out.write(
            f"stopped at line {report.resume_line} ({report.stopped_by}); every entry before "
            f"it is warmed or listed as failed. Resume with --start-line {report.resume_line}\n"
        )


def _warm_failures(report: WarmReport, path: str, err: TextIO) -> None:
    for failure in report.failures:
        err.write(redact(f"{path}:{failure.line}: {failure.reason}") + "\n")
    hidden = report.failed - len(report.failures)
    if hidden > 0:
        err.write(f"... and {hidden} more failed line(s)\n")


def _exit_code(report: WarmReport) -> int:
    """130 after Ctrl-C, 2 after a Redis or read error, 1 if some lines failed."""
    if report.stopped_by == STOPPED_BY_SIGINT:
        return EXIT_INTERRUPTED
    if report.stopped_by is not None:
        return EXIT_ERROR
    return EXIT_PARTIAL if report.failed or report.not_cached else 0


def _opened(path: str) -> BinaryIO:
    """The JSONL source. "-": standard input, as most tools read it (``zcat x.gz | ...
    --from -``), but not a terminal: lines are read in the event loop, where a read
    blocked on a terminal left Ctrl-C unheard. fd 0 closed (cron): ``os.dup`` raises."""
    if path == "-" and os.isatty(0):
        raise CliError("-: standard input is a terminal: pipe the JSONL into it")
    try:
        if path == "-":
            return os.fdopen(os.dup(0), "rb")
        return open(path, "rb")  # the caller's with closes it
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror or exc}") from None


def cmd_warm(args: argparse.Namespace, out: TextIO) -> int:
    """The summary goes to ``out``; progress and failed lines to stderr."""
    config = load(args.config)
    if args.concurrency < 1:
        raise CliError("--concurrency must be >= 1")
    if args.start_line < 1:
        raise CliError("--start-line must be >= 1")
    warm = WarmArgs(args.namespace, args.source, args.concurrency, args.start_line)
    with _opened(warm.path) as source:
        report = run(_warm(config, warm, source, sys.stderr))
    _warm_failures(report, warm.path, sys.stderr)
    _warm_summary(report, warm, out)
    return _exit_code(report)
