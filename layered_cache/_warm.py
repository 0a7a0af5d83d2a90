"""``layered-cache warm``: stream a JSONL file into a namespace through ``cache.set_many``.

Why a module of its own: warming is a small pipeline with a contract the rest of the CLI
lacks. Memory stays flat in the file size (one line is parsed when a writer is free, at
most ``concurrency`` entries are held), and no entry is ever silently missing: every
entry ends warmed, failed (reported with its line number) or at/after the reported
resume line. The first SIGINT stops reading and lets in-flight writes finish; a second
one cancels them. Neither raises ``KeyboardInterrupt`` inside the loop, so no task dies
with an exception nobody retrieves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from typing import BinaryIO

import msgspec

from layered_cache._cache import LayeredCache
from layered_cache._l2 import L2Unavailable
from layered_cache._policy import Policy
from layered_cache._progress import Progress
from layered_cache._redact import redact
from layered_cache._warm_lines import Entry, Failure, JsonlReader

__all__ = ["Entry", "Failure", "JsonlReader", "Progress", "WarmReport", "Warmer"]

SHOWN_FAILURES = 10
STOPPED_BY_SIGINT = "SIGINT"
STOPPED_BY_REDIS = "Redis error"


class WarmReport(msgspec.Struct):
    """The outcome. ``resume_line`` is set when the run stopped early: every entry on a
    line before it is in Redis or listed as failed; ``--start-line`` resumes there."""

    read: int = 0  # entries (non-blank lines) taken from the file
    warmed: int = 0
    failed: int = 0
    failures: list[Failure] = msgspec.field(default_factory=list)
    stopped_by: str | None = None
    resume_line: int | None = None
    not_cached: int = 0


# A writer's set_many chunk: up to this many entries or bytes of input, whichever comes
# first (one round trip each; memory stays flat whatever the size of the values).
CHUNK = 100
CHUNK_BYTES = 32 * 1024


class Warmer:
    """Runs ``concurrency`` writers over one reader and keeps the books for the report."""

    def __init__(
        self,
        cache: LayeredCache,
        policy: Policy,
        reader: JsonlReader,
        concurrency: int,
        progress: Progress,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.reader = reader
        self.concurrency = concurrency
        self.progress = progress
        self.report = WarmReport()
        self._entries = iter(reader)
        self._pending: set[int] = set()  # lines taken whose write has not succeeded
        # Each key's latest write still running: a later line of the key waits for it.
        self._writing: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._interrupts = 0

    def interrupt(self) -> None:
        """SIGINT: the first stops reading (in-flight writes finish), the next cancels
        the writes in flight; their lines stay pending, so the resume line covers them."""
        self._interrupts += 1
        self._stop(STOPPED_BY_SIGINT)
        if self._interrupts > 1:
            for task in self._tasks:
                task.cancel()

    async def run(self) -> WarmReport:
        stats = self.policy.stats
        # Refused by a full Redis counts as not cached too: those are failures here.
        not_cached_before = stats.not_cached - stats.refused_full
        self.progress.update(0, 0, self.reader.start_line, force=True)  # at once, not after a write
        self._tasks = [asyncio.create_task(self._writer()) for _ in range(self.concurrency)]
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        self.progress.update(self.reader.position, self.report.warmed, self._line(), force=True)
        self.progress.finish()
        for result in results:  # a bug must surface, not leave entries silently unwritten
            if isinstance(result, Exception):
                raise result
        if self.report.stopped_by is not None:
            self.report.resume_line = self._line()
        self.report.not_cached = stats.not_cached - stats.refused_full - not_cached_before
        return self.report

    def _line(self) -> int:
        """The first line not yet warmed nor failed for good."""
        return min(self._pending, default=self.reader.next_line)

    def _stop(self, reason: str) -> None:
        if self.report.stopped_by is None:
            self.report.stopped_by = reason

    async def _writer(self) -> None:
        while self.report.stopped_by is None:
            entries = self._take(CHUNK)
            if not entries:
                return
            done = asyncio.Event()
            earlier = self._claim(entries, done)  # no await since the take: file order
            try:
                for write in earlier:
                    await write.wait()
                await self._write(entries)
            finally:
                done.set()
                for key in self._keys(entries):
                    if self._writing.get(key) is done:
                        del self._writing[key]

    def _claim(self, entries: list[Entry], done: asyncio.Event) -> set[asyncio.Event]:
        """The writes of earlier chunks holding one of these keys, which ours must follow:
        a key given twice keeps its last line. Chunks go to concurrent writers, and a
        later line's write could land first (the earlier chunk's writer still busy with
        its own tagged entries, one round trip each), leaving the earlier line's value."""
        earlier = set()
        for key in self._keys(entries):
            write = self._writing.get(key)
            if write is not None and write is not done:
                earlier.add(write)
            self._writing[key] = done
        return earlier

    def _keys(self, entries: list[Entry]) -> set[str]:
        keys = set()
        for entry in entries:
            with contextlib.suppress(KeyError, TypeError, ValueError):  # refused on write
                keys.add(self.policy.template.build(entry.fields))
        return keys

    def _take(self, count: int) -> list[Entry]:
        """Up to ``count`` valid entries; bad lines are counted on the way."""
        entries: list[Entry] = []
        size = 0
        while len(entries) < count and size < CHUNK_BYTES and self.report.stopped_by is None:
            try:
                item = next(self._entries, None)
            except (OSError, ValueError) as exc:  # the file went away (unmounted, closed)
                self._stop(redact(f"read error: {getattr(exc, 'strerror', None) or exc}"))
                break
            if item is None:
                break
            self.report.read += 1
            if isinstance(item, Failure):
                self._fail(item)
            else:
                entries.append(item)
                size += item.size
        return entries

    async def _write(self, entries: list[Entry]) -> None:
        """The chunk in line order: each run of untagged entries in one ``set_many``,
        each tagged one by ``set(tags=)`` (``set_many`` takes no tags), until Redis stops
        the run. In order, as a key given twice keeps its last line (all untagged ones
        first let an earlier tagged line overwrite a later untagged one). Every line is
        pending from the start, so a stop's resume line covers them all."""
        self._pending.update(entry.line for entry in entries)
        for tagged, run in itertools.groupby(entries, key=lambda entry: bool(entry.tags)):
            if self.report.stopped_by == STOPPED_BY_REDIS:
                return
            if not tagged:
                await self._write_chunk(list(run))
                continue
            for entry in run:
                if self.report.stopped_by != STOPPED_BY_REDIS:
                    await self._write_one(entry)

    async def _write_chunk(self, entries: list[Entry]) -> None:
        """One ``set_many`` (one round trip, one backplane append) per chunk."""
        lines = [entry.line for entry in entries]
        refused_before = self.policy.stats.refused_full
        try:
            await self.cache.set_many(self.policy.name, [(e.fields, e.value) for e in entries])
            if self.policy.stats.refused_full != refused_before:
                # A Redis full under noeviction refused values: set_many dropped their
                # keys and returned. Not warmed: the chunk stays pending (which of its
                # entries were refused can't be told, another writer's refusals count
                # too) and the run stops, as on a Redis error.
                raise L2Unavailable("full (maxmemory, noeviction): refused values")
        except L2Unavailable as exc:  # they stay pending: a resumed run writes them again
            self._fail(Failure(lines[0], redact(f"Redis: {exc}")))
            self._stop(STOPPED_BY_REDIS)
            return
        except Exception:  # an entry's own problem: find it, write the others
            for entry in entries:
                await self._write_one(entry)
            return
        self._pending.difference_update(lines)
        self.report.warmed += len(entries)
        self.progress.update(self.reader.position, self.report.warmed, self._line())

    async def _write_one(self, entry: Entry) -> None:
        refused_before = self.policy.stats.refused_full
        try:
            await self.cache.set(self.policy.name, entry.fields, entry.value, entry.tags or None)
            if self.policy.stats.refused_full != refused_before:  # see ``_write``
                raise L2Unavailable("full (maxmemory, noeviction): refused values")
        except L2Unavailable as exc:
            self._fail(Failure(entry.line, redact(f"Redis: {exc}")))
            self._stop(STOPPED_BY_REDIS)
            return
        except Exception as exc:
            self._pending.discard(entry.line)
            self._fail(Failure(entry.line, redact(f"{type(exc).__name__}: {exc}")))
            return
        self._pending.discard(entry.line)
        self.report.warmed += 1

    def _fail(self, failure: Failure) -> None:
        """Count it; keep the ``SHOWN_FAILURES`` lowest lines (writers finish out of
        order), so the report starts with the first bad line of the file."""
        self.report.failed += 1
        shown = self.report.failures
        shown.append(failure)
        if len(shown) > SHOWN_FAILURES:
            shown.remove(max(shown, key=lambda f: f.line))
        shown.sort(key=lambda f: f.line)


def file_size(source: BinaryIO) -> int:
    """Bytes in a regular file; 0 (no percentage) for a pipe."""
    try:
        return os.fstat(source.fileno()).st_size
    except (OSError, ValueError):
        return 0
