"""The lines of a ``layered-cache warm`` file (``_warm``): each one read, parsed and
judged the way ``cache.set`` would judge it, so that a bad line is a numbered failure,
not an exception halfway through a run nor a value ``set`` drops without a word; and
read in flat memory whatever the file holds (an over-long line is skipped unread)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, BinaryIO

import msgspec

from layered_cache._namespace import check_tags
from layered_cache._policy import Policy
from layered_cache._redact import redact
from layered_cache._tags import new_version

__all__ = ["BOM", "LINE_FACTOR", "LINE_SLACK", "MEMBERS", "Entry", "Failure", "JsonlReader"]


class Entry(msgspec.Struct, frozen=True):
    """One valid line: the key fields, the value to write and the tags it carries."""

    line: int
    fields: dict[str, object]
    value: Any
    size: int = 0  # bytes of the line: bounds a writer's chunk (memory stays flat)
    tags: tuple[str, ...] = ()


class Failure(msgspec.Struct, frozen=True):
    """An entry that was not written, with why (already redacted)."""

    line: int
    reason: str


BOM = b"\xef\xbb\xbf"
# What a line may hold. Any other member is refused, not dropped: a misspelt "vaule", a
# "ttl" warm does not apply, would otherwise vanish without a word.
MEMBERS = ("key", "value", "tags")
# A line longer than LINE_FACTOR * max_value_bytes + LINE_SLACK is refused unread.
LINE_FACTOR = 8
LINE_SLACK = 64 * 1024


class JsonlReader:
    """Lines of a JSONL file as ``Entry`` or ``Failure``, one at a time.

    Each line is validated the way ``cache.set`` would see it (JSON shape, key fields, tags,
    encodable value within ``max_value_bytes``), so a bad line becomes a numbered
    failure instead of an exception halfway through, or a value ``set`` drops quietly.
    Lines before ``start_line`` are skipped unparsed."""

    def __init__(self, source: BinaryIO, policy: Policy, start_line: int = 1) -> None:
        self._source = source
        self._policy = policy
        self.start_line = start_line
        self.next_line = 1  # the number of the next line to read
        self.position = 0  # bytes consumed so far

    @property
    def line_limit(self) -> int:
        """The longest line read: ``LINE_FACTOR`` x ``max_value_bytes`` (JSON may spell a
        value out longer than its encoding: escapes, whitespace) plus ``LINE_SLACK`` for
        the key. A longer line can hold no valid entry; reading it whole (a dump without
        newlines: gigabytes) would cost that much memory just to refuse it."""
        return LINE_FACTOR * self._policy.max_value_bytes + LINE_SLACK

    def __iter__(self) -> Iterator[Entry | Failure]:
        limit = self.line_limit
        while raw := self._source.readline(limit + 1):
            number = self.next_line
            self.next_line += 1
            self.position += len(raw)
            if number == 1 and raw.startswith(BOM):
                # An editor's byte-order mark (PowerShell, Notepad "UTF-8 with BOM") is a
                # mark of the file, not part of line 1's JSON: line 1 was refused.
                raw = raw[len(BOM) :]
            if len(raw) > limit and not raw.endswith(b"\n"):
                self.position += self._skip_rest(limit)
                if number >= self.start_line:
                    yield Failure(number, f"line too long: over {limit} bytes ({LINE_FACTOR} "
                                  f"x max_value_bytes {self._policy.max_value_bytes} + "
                                  f"{LINE_SLACK}), skipped unread")  # fmt: skip
                continue
            if number < self.start_line or not raw.strip():
                continue
            yield self._parse(number, raw)

    def _skip_rest(self, chunk: int) -> int:
        """Read past the rest of an over-long line, ``chunk`` bytes at a time (memory
        stays flat); the bytes skipped."""
        skipped = 0
        while part := self._source.readline(chunk):
            skipped += len(part)
            if part.endswith(b"\n"):
                break
        return skipped

    def _parse(self, number: int, raw: bytes) -> Entry | Failure:
        try:
            record = json.loads(raw.decode("utf-8"), parse_constant=_refuse, parse_float=_finite)
        except UnicodeDecodeError:
            return Failure(number, "not UTF-8")
        except json.JSONDecodeError as exc:
            return Failure(number, f"not valid JSON: {exc.msg}")
        except (ValueError, RecursionError) as exc:  # a 5,000-digit int, 100,000-deep nesting
            # Not a read error of the file: this line is bad, the next ones are read on.
            return Failure(number, f"not valid JSON: {type(exc).__name__}: {str(exc)[:200]}")
        if not isinstance(record, dict) or "key" not in record or "value" not in record:
            return Failure(number, 'expected {"key": {...}, "value": ...}')
        if unknown := sorted(set(record) - set(MEMBERS)):
            return Failure(number, f"unknown member(s) {unknown}: a line takes {list(MEMBERS)}")
        fields, tags = record["key"], record.get("tags")
        if not isinstance(fields, dict):
            return Failure(number, "key must be an object of key fields")
        problem = (
            self._key_problem(fields)
            or self._tags_problem(tags)
            or self._value_problem(record["value"], tags or [])
        )
        if problem is not None:
            return Failure(number, redact(problem))
        return Entry(number, fields, record["value"], len(raw), tuple(tags or ()))

    def _key_problem(self, fields: dict[str, object]) -> str | None:
        template = self._policy.template
        unknown = sorted(set(fields) - set(template.fields))
        if unknown:  # two lines differing only there would write one key, the last wins
            return f"unknown key field(s) {unknown} (template {template.template!r})"
        try:
            template.build(fields)
        except (KeyError, ValueError) as exc:
            return str(exc.args[0]) if exc.args else str(exc)
        return None

    def _tags_problem(self, tags: object) -> str | None:
        """The line's tags as ``set(tags=)`` judges them (a namespace without
        ``tags = true``, a bad or over-long tag, too many); null is no tags, as None is."""
        if tags is not None and not isinstance(tags, list):
            return f"tags must be a list of strings, got {type(tags).__name__}"
        try:
            check_tags(self._policy, tags)
        except (TypeError, ValueError) as exc:
            return f"tags: {exc}"
        return None

    def _value_problem(self, value: Any, tags: list[str]) -> str | None:
        """The envelope as ``set()`` writes it: its size does not depend on the
        timestamps (fixed-width floats), and a tag's version is always 16 characters
        (``_tags.new_version``); without its tags a line that fits only untagged was
        counted as warmed, then dropped by set()."""
        versions = {tag: _VERSION for tag in tags} if tags else None
        try:
            size = len(self._policy.codec.encode(value, 0.0, 0.0, 0.0, versions))
        except (TypeError, ValueError, OverflowError) as exc:
            return f"value not encodable: {exc}"
        if size > self._policy.max_value_bytes:
            return f"value too large: {size} bytes > max_value_bytes {self._policy.max_value_bytes}"
        return None


_VERSION = new_version()  # any version: they are all 16 characters


def _refuse(constant: str) -> Any:
    """Python's ``json`` takes NaN and Infinity, which JSON has not."""
    raise ValueError(f"{constant} is not JSON")


def _finite(text: str) -> float:
    """A JSON number too large for a float (``1e400``) would be stored as infinity."""
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text[:40]} is too large for a float")
    return number
