"""Redis replies (RESP2 and RESP3) parsed in one pass over the bytes a socket delivered,
for the backplane listener's XREAD (``_direct.HeldConnection``).

Why not redis-py's parser: it awaits the stream for every line and bulk string of a
reply, and an XREAD entry is eight of them (the entry, its ID, its field array, two
field/value pairs). Every instance's listener reads every entry any writer appends, its
own writes included, so that per-entry cost is paid fleet-wide for each invalidation:
on the bench machine ~19 µs of CPU per entry with redis-py's parser, ~5 µs here
(docs/benchmarks.md, "set()").

A reply that arrived whole (nearly every one) is read by one recursive pass with the
bulk strings of an aggregate inline (``_whole``): an XREAD of six entries ~45 -> ~30 µs,
an MGET of 50 values ~98 -> ~70 µs on the bench VM. A reply that arrives in pieces is
resumed where parsing stopped, element by element: each element is parsed once however
the bytes are split; that path also reads the rare kinds and the malformed
(``tests/test_replies.py`` checks both paths agree on any bytes, broken ones too). Read:
bulk, verbatim and simple strings (bytes), integers, big numbers, doubles, booleans,
nulls, arrays and sets (lists), maps (dicts), and errors (the exception redis-py would
raise for the error code, returned as the value). A RESP3 push frame (``>``, e.g.
redis-py's maintenance notifications, which an open-source Redis doesn't send) is not a
reply: it is skipped. Anything else raises ``ProtocolError``, and the caller drops the
connection.
"""

from __future__ import annotations

from typing import Any

from redis._parsers import BaseParser
from redis.exceptions import RedisError

__all__ = ["ProtocolError", "ReplyParser"]

_AGGREGATES = frozenset(b"*~%>")  # array, set, map, push
_STRINGS = frozenset(b"$=")  # bulk, verbatim
_MAP, _PUSH, _VERBATIM = ord("%"), ord(">"), ord("=")


class ProtocolError(RedisError):
    """Redis sent something that is not a reply: the connection can't be trusted. A
    ``RedisError``, so the listener treats it as any other Redis failure (reconnect)."""


class _Aggregate:
    """An array, set, map or push frame whose elements are still being read."""

    __slots__ = ("items", "kind", "left")

    def __init__(self, kind: int, left: int) -> None:
        self.kind = kind
        self.left = left
        self.items: list[Any] = []

    def value(self) -> Any:
        items = self.items
        return dict(zip(items[::2], items[1::2], strict=True)) if self.kind == _MAP else items


class ReplyParser:
    """Feed it bytes; ``reply()`` returns each reply once it is complete."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._position = 0  # where the next element starts
        self._open: list[_Aggregate] = []  # aggregates being read, innermost last

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def buffered(self) -> int:
        """Bytes fed and not yet dropped (what an unread reply holds in memory)."""
        return len(self._buffer)

    def reply(self) -> tuple[bool, Any]:
        """``(True, reply)`` once a whole reply was fed (its bytes are then dropped), or
        ``(False, None)``: feed more."""
        if self._position == len(self._buffer):
            # Nothing left to read: every command asks once before its reply arrives,
            # and a failed one-pass attempt costs a caught exception.
            return False, None
        if not self._open:
            # A reply that arrived whole (nearly every one) in one recursive pass; the
            # element-by-element path below resumes a split one and reads the rare
            # kinds (errors, pushes, doubles, ...) and anything malformed.
            try:
                value, end = _whole(self._buffer, self._position)
            # IndexError: it ends mid-aggregate; RecursionError: nested past the stack
            # (the element-by-element path needs no recursion).
            except (_NotHere, IndexError, RecursionError):
                pass
            else:
                del self._buffer[:end]
                self._position = 0
                return True, value
        while True:
            element = self._element()
            if element is None:
                return False, None
            done, value = self._close(element[0])
            if done:
                del self._buffer[: self._position]
                self._position = 0
                return True, value

    def whole_replies(self, most: int) -> list[Any]:
        """Up to ``most`` replies that are whole in what was fed, read in one pass and
        their bytes dropped once (a transaction's hundred ``+QUEUED`` arrive together);
        fewer, maybe none, where the fed bytes end or a reply needs ``reply()``."""
        replies: list[Any] = []
        if self._open:
            return replies
        position = self._position
        while len(replies) < most:
            try:
                value, position = _whole(self._buffer, position)
            except (_NotHere, IndexError, RecursionError):  # as ``reply``
                break
            replies.append(value)
        del self._buffer[:position]
        self._position = 0
        return replies

    def _element(self) -> tuple[Any] | None:
        """The next scalar element, in a 1-tuple; None if it is incomplete. An
        aggregate's header opens it and is not an element: the loop goes on to its
        first one."""
        buffer = self._buffer
        while True:
            start = self._position
            end = buffer.find(b"\r\n", start)
            if end < 0:
                return None
            kind, line = buffer[start], buffer[start + 1 : end]
            if kind in _STRINGS:
                return self._string(kind, line, end)
            self._position = end + 2
            if kind not in _AGGREGATES:
                return (_scalar(kind, line),)
            count = _length(line)
            if count < 0:
                return (None,)  # a RESP2 null array
            if count == 0:
                if kind == _PUSH and not self._open:
                    continue  # an empty out-of-band push: not the reply
                return ({} if kind == _MAP else [],)
            self._open.append(_Aggregate(kind, count * 2 if kind == _MAP else count))

    def _string(self, kind: int, line: bytearray, end: int) -> tuple[Any] | None:
        """A bulk (``$``, null as ``$-1``) or verbatim (``=``) string; None if its
        bytes have not all arrived."""
        size = _length(line)
        if size < 0:
            self._position = end + 2
            return (None,)
        stop = end + 2 + size
        if len(self._buffer) < stop + 2:
            return None
        if self._buffer[stop : stop + 2] != b"\r\n":
            raise ProtocolError("a bulk string is not followed by CRLF")
        self._position = stop + 2
        # A verbatim string starts with its format ("txt:"), which redis-py drops too.
        return (bytes(self._buffer[end + 2 + (4 if kind == _VERBATIM else 0) : stop]),)

    def _close(self, value: Any) -> tuple[bool, Any]:
        """Put ``value`` into the innermost open aggregate, closing each one it
        completes. Whether a top-level reply is complete, and it."""
        while self._open:
            aggregate = self._open[-1]
            aggregate.items.append(value)
            aggregate.left -= 1
            if aggregate.left:
                return False, None
            self._open.pop()
            if aggregate.kind == _PUSH and not self._open:
                return False, None  # an out-of-band push: not the reply
            value = aggregate.value()
        return True, value


class _NotHere(Exception):
    """Not for the one-pass reader: an incomplete reply, or a kind it leaves to the
    element-by-element parser."""


def _whole(buffer: bytearray, start: int) -> tuple[Any, int]:
    """The reply starting at ``start`` if all of it is in ``buffer``, and where it ends:
    bulk and simple strings, integers, nulls, arrays, sets and maps, read as the
    element-by-element parser reads them. Raises ``_NotHere`` for anything else."""
    end = buffer.find(b"\r\n", start)
    if end < 0:
        raise _NotHere
    kind = buffer[start]
    try:
        size = int(buffer[start + 1 : end]) if kind in _SIZED else 0
    except ValueError:
        raise _NotHere from None
    if kind == 36:  # $
        if size < 0:
            return _null(size, end)
        stop = end + 2 + size
        if len(buffer) < stop + 2 or buffer[stop : stop + 2] != b"\r\n":
            raise _NotHere
        return bytes(buffer[end + 2 : stop]), stop + 2
    if kind == 42 or kind == 126 or kind == 37:  # * ~ %
        if size < 0:
            if kind != 42:  # only RESP2's null array is read here
                raise _NotHere
            return _null(size, end)
        items, position = _elements(buffer, size * 2 if kind == 37 else size, end + 2)
        value = dict(zip(items[::2], items[1::2], strict=True)) if kind == 37 else items
        return value, position
    if kind == 58:  # :
        return size, end + 2
    if kind == 43:  # +
        return bytes(buffer[start + 1 : end]), end + 2
    if kind == 95 and end == start + 1:  # _
        return None, end + 2
    raise _NotHere


_SIZED = frozenset(b"$*~%:")  # kinds whose line is a number


def _elements(buffer: bytearray, count: int, position: int) -> tuple[list[Any], int]:
    """An aggregate's ``count`` elements from ``position`` (``_whole``), the bulk
    strings inline: most elements are (XREAD entries, MGET values). An IndexError means
    the buffer ends first, as ``_NotHere`` does."""
    items: list[Any] = []
    find = buffer.find
    for _ in range(count):
        if buffer[position] != 36:  # not $
            item, position = _whole(buffer, position)
            items.append(item)
            continue
        line = find(b"\r\n", position)
        if line < 0:
            raise _NotHere
        try:
            length = int(buffer[position + 1 : line])
        except ValueError:
            raise _NotHere from None
        if length < 0:
            if length != -1:
                raise _NotHere
            items.append(None)  # RESP2's null bulk string
            position = line + 2
            continue
        stop = line + 2 + length
        if buffer[stop : stop + 2] != b"\r\n":  # also when it is short: incomplete
            raise _NotHere
        items.append(bytes(buffer[line + 2 : stop]))
        position = stop + 2
    return items, position


def _null(size: int, end: int) -> tuple[None, int]:
    if size != -1:
        raise _NotHere
    return None, end + 2


def _number(line: bytearray) -> int:
    try:
        return int(line)
    except ValueError:
        raise ProtocolError(f"bad length or integer in a reply: {bytes(line[:32])!r}") from None


def _length(line: bytearray) -> int:
    """An aggregate's or a bulk string's length; -1 is RESP2's null."""
    length = _number(line)
    if length < -1:
        raise ProtocolError(f"negative length in a reply: {length}")
    return length


def _scalar(kind: int, line: bytearray) -> Any:
    if kind == 43:  # +
        return bytes(line)
    if kind == 58 or kind == 40:  # : and ( (a big number)
        return _number(line)
    if kind == 95:  # _
        return None
    if kind == 45:  # -
        error: Exception = BaseParser.parse_error(line.decode(errors="replace"))  # type: ignore[no-untyped-call]
        return error
    if kind == 35:  # #
        return line == b"t"
    if kind == 44:  # ,
        try:
            return float(line)
        except ValueError:
            raise ProtocolError(f"bad double in a reply: {bytes(line[:32])!r}") from None
    raise ProtocolError(f"unexpected reply type {chr(kind)!r}")
