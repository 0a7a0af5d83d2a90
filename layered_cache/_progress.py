"""The progress line of ``layered-cache warm`` on stderr: a bar on a terminal, a dozen
plain lines anywhere else. Its own module: it knows nothing of the warming it shows."""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress on a stream. On a terminal: one line redrawn with ``\\r`` at most 10
    times a second. Anywhere else (a log file, CI, a pipe), where a ``\\r`` only piles
    every redraw onto one endless line: plain lines, the first, one per 10 % of the file,
    one at least every ``PLAIN_INTERVAL`` seconds (a file too big for 10 % to come soon),
    and the last: a dozen lines for any file size.

    The total is the file's size in bytes, known before anything is read, so the bar
    moves from the first line on instead of after a full pass over the file."""

    TTY_INTERVAL = 0.1
    PLAIN_INTERVAL = 30.0
    PLAIN_STEPS = 10  # a plain line per tenth of the file

    def __init__(self, total_bytes: int, label: str, stream: TextIO, width: int = 30) -> None:
        self.total = total_bytes
        self.label = label
        self.stream = stream
        self.width = width
        self.tty = _isatty(stream)
        self._drawn = 0.0
        self._step = 0  # plain lines: the tenths of the file already reported
        self._started = time.monotonic()
        self._open = False
        self._said: tuple[str, int, int] | None = None  # the last plain line, rate apart

    def update(self, position: int, warmed: int, line: int, force: bool = False) -> None:
        now = time.monotonic()
        # A pipe has no size: no bar and no percentage (it showed 100% from line 1).
        fraction = min(position / self.total, 1.0) if self.total else None
        if not (force or self._due(now, fraction)):
            return
        self._drawn = now
        rate = warmed / max(now - self._started, 1e-6)
        counts = f"line {line}, {warmed} warmed, {rate:,.0f}/s"
        if self.tty:
            bar = ""
            if fraction is not None:
                filled = int(fraction * self.width)
                bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {fraction:4.0%} "
            self.stream.write(f"\r{self.label} {bar}{counts}")
            self._open = True
        else:
            done = "" if fraction is None else f"{fraction:.0%}, "
            if (done, line, warmed) == self._said:
                return  # the last line already said it (the 100 % step, then the last)
            self._step, self._said = int((fraction or 0.0) * self.PLAIN_STEPS), (done, line, warmed)
            self.stream.write(f"{self.label}: {done}{counts}\n")
        self.stream.flush()

    def _due(self, now: float, fraction: float | None) -> bool:
        if self.tty:
            return now - self._drawn >= self.TTY_INTERVAL
        return (
            fraction is not None and int(fraction * self.PLAIN_STEPS) > self._step
        ) or now - self._drawn >= self.PLAIN_INTERVAL

    def finish(self) -> None:
        """End the line, so whatever is printed next starts on a line of its own."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False
