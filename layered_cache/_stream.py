"""What the backplane stream's replies mean: entry IDs, XREAD replies, and the XINFO
test for entries trimmed before a reader got to them.

Pure functions of replies, shared by the instances' listener (``_backplane``) and the
relay (``_relay``), which must judge a stream the same way: a relay that read gaps more
leniently than its instances would let them serve what they should have dropped.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FUTURE_SLACK",
    "Entry",
    "ahead_of_clock",
    "last_generated",
    "missed_entries",
    "oldest_entry",
    "parse_id",
    "stream_field",
    "stream_info",
    "trim_visible",
    "xread_entries",
]

# How far ahead of Redis's clock (as the reader measures it: ``_redisclock``) a reader's
# position may be before an idle read counts it as "the IDs went back" and checks the
# stream: beyond the measurement's error and any NTP-level step of Redis's own clock.
FUTURE_SLACK = 10.0

# A stream entry as the listener reads it: its ID and its field -> value pairs.
Entry = tuple[bytes, dict[bytes, bytes]]


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    millis, _, seq = text.partition("-")
    return int(millis), int(seq or 0)


def ahead_of_clock(position: bytes, redis_now: float, host_now: float) -> bool:
    """Whether an idle reader's ``position`` is more than ``FUTURE_SLACK`` ahead of the
    earlier of ``redis_now`` (Redis's time as the reader measures it, ``_redisclock``)
    and ``host_now``: the stream's IDs went back (it was deleted and created anew after
    Redis's clock stepped back, or an ID was forged), and an XREAD after it may wait for
    ever. The reader checks the stream.

    Redis's time: stream IDs are its clock's, and a host 30 s ahead of it took a
    position up to 40 s ahead of Redis for current (deaf for that long). But the
    earlier of the two: right after Redis's clock stepped back, the measured offset is
    the one from before the step until the next sample (``REFRESH``, 30 s), and against
    it alone a host with the right time took the new, lower IDs' stream for current. A
    host behind Redis checks more often than it needs (an XINFO per idle read)."""
    return parse_id(position)[0] > (min(redis_now, host_now) + FUTURE_SLACK) * 1000


def xread_entries(reply: Any) -> list[Entry]:
    """The entries of a raw XREAD reply of one stream: RESP3 (a map, stream -> entries),
    RESP2 (an array of [stream, entries]: a relay speaks only RESP2), or nil when the
    block timed out. An entry's fields come as a flat [field, value, ...] array."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [entries for _, entries in reply]
    return [
        (bytes(entry_id), dict(zip(fields[::2], fields[1::2], strict=True)) if fields else {})
        for entries in streams
        for entry_id, fields in entries
    ]


def stream_info(reply: Any) -> dict[Any, Any]:
    """XINFO STREAM's reply as a mapping: RESP3 sends a map, RESP2 (a relay, or
    ``?protocol=2``) a flat [field, value, ...] array, and redis-py's ``xinfo_stream()``
    has already made it a dict."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


def trim_visible(batch: int, maxlen: int | None) -> int:
    """How many entries one XREAD must return for a trim past the reader's position to
    be possible, so that a shorter read needs no XINFO check.

    ``MAXLEN ~`` keeps at least ``maxlen`` entries, so a trim that removed entries after
    our position left at least ``maxlen`` after it, and XREAD returns them up to a
    batch: a shorter read proves nothing we had not read was trimmed. (A connected
    reader that stalled past ``maxlen`` entries gets fewer than a full batch: a check on
    full batches only missed that.) An operator's XTRIM below ``maxlen`` or XDEL is
    seen after a disconnect or a long read only."""
    return min(batch, maxlen) if maxlen is not None else batch


def stream_field(info: Any, name: str) -> Any:
    """An XINFO STREAM field, whether the client decodes replies (str keys) or not."""
    return info.get(name, info.get(name.encode()))


def last_generated(info: Any) -> bytes | None:
    """The ID of the newest entry the stream ever had (its ``last-generated-id``)."""
    last = stream_field(info, "last-generated-id")
    if last is None:
        return None
    return last if isinstance(last, bytes) else str(last).encode()


def oldest_entry(info: Any) -> tuple[int, int]:
    """The ID of the stream's oldest entry (of the newest it ever had, when empty)."""
    first = stream_field(info, "first-entry")
    if first:
        return parse_id(first[0])
    last = stream_field(info, "last-generated-id")
    return parse_id(last) if last is not None else (0, 0)


def missed_entries(info: Any, ours: tuple[int, int]) -> bool:
    """Whether entries after ``ours`` may be gone. Conservative: clearing L1 costs
    some reloads, missing an invalidation serves a stale value for a whole TTL.

    ``max-deleted-entry-id`` only moves on XDEL; MAXLEN trimming leaves it at 0-0,
    so trimming is detected by the first entry having moved past our position (then
    the entry right after ours may have been trimmed too).
    """
    deleted = stream_field(info, "max-deleted-entry-id")
    if deleted is not None and parse_id(deleted) > ours:
        return True  # an XDEL removed an entry we have not read
    last = stream_field(info, "last-generated-id")
    if last is not None and parse_id(last) < ours:
        return True  # IDs went back: the stream was deleted and created anew
    first = stream_field(info, "first-entry")
    if not first:
        # Empty (XTRIM MAXLEN 0, or every entry XDELed): anything added after our
        # position is gone unread.
        return last is not None and parse_id(last) > ours
    if parse_id(first[0]) <= ours:
        return False
    if ours == (0, 0):
        # We started before the stream existed: XREAD from 0-0 reads every entry
        # still there; only entries trimmed before we read them are lost.
        added, length = stream_field(info, "entries-added"), stream_field(info, "length")
        return added is not None and length is not None and int(added) > int(length)
    return True
