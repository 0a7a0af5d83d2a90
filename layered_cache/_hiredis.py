"""Which reply parser the library's own connections use (``_direct``): hiredis's C reader
when redis-py uses it, else ``_replies.ReplyParser``.

Why: the backplane listener parses every entry any writer appends, its own included,
and in pure Python that is ~4 µs per entry (eight RESP elements), most of what a
writer's own listener costs per ``set()``; a set_many's hundred ``+QUEUED`` replies and
an MGET's values are the same kind of work. hiredis reads the same bytes ~20x faster
(docs/benchmarks.md, "set()"). It is used exactly when redis-py uses it (installed,
and a version redis-py accepts: ``redis.utils.HIREDIS_AVAILABLE``), so a service reads
every reply with one parser, and with one that has a ``PushNotification`` type (3.2 and
later): a RESP3 push frame must be told apart from a reply, or it would be taken for
the reply of the command after it.

Where the two differ, only on what a Redis or Valkey never sends in reply to the
library's commands: hiredis returns a RESP3 big number as bytes (``ReplyParser`` an
int), reads a blob error (``!``) and an attribute frame (``|``, which it returns as a
reply of its own: ``ReplyParser`` refuses it), doesn't check the CRLF after a bulk
string, and refuses a reply nested deeper than its stack (``ProtocolError``).
``tests/test_hiredis_replies.py`` checks that both read every kind a server does send
alike, however the bytes are split, and pins these differences.
"""

from __future__ import annotations

from typing import Any, Protocol

from redis._parsers import BaseParser
from redis.utils import HIREDIS_AVAILABLE

from layered_cache._replies import ProtocolError, ReplyParser

__all__ = ["USE_HIREDIS", "HiredisParser", "Parser", "new_parser"]

try:
    import hiredis

    USE_HIREDIS = HIREDIS_AVAILABLE and hasattr(hiredis, "PushNotification")
except ImportError:  # not installed: the pure-Python parser
    USE_HIREDIS = False

_MORE = object()  # hiredis's "not enough data" answer
# Bytes fed after which a reader that has read all it was fed is replaced by a new one:
# hiredis keeps its buffer's allocation (one reply's size) after the reply is read, and
# frees it only on the next feed, so a connection idle in ``DirectClient``'s stack after
# a 20 MB MGET held 20 MB (ten of them +219 MB RSS; ``ReplyParser`` drops its bytes).
_FRESH_AFTER = 1 << 20


class Parser(Protocol):
    """What ``_direct`` asks of a reply parser (``ReplyParser`` documents each)."""

    def feed(self, data: bytes) -> None: ...

    def buffered(self) -> int: ...

    def reply(self) -> tuple[bool, Any]: ...

    def whole_replies(self, most: int) -> list[Any]: ...


class HiredisParser:
    """``ReplyParser``'s interface on a ``hiredis.Reader``: an error reply is the
    exception redis-py would raise for it (returned as the value, as ``ReplyParser``
    does), a push frame is skipped, anything malformed raises ``ProtocolError`` (the
    caller drops the connection)."""

    __slots__ = ("_fed", "_push", "_reader")

    def __init__(self) -> None:
        self._push = hiredis.PushNotification
        self._reader = _new_reader()
        self._fed = 0  # bytes fed to this reader

    def feed(self, data: bytes) -> None:
        self._reader.feed(data)
        self._fed += len(data)

    def buffered(self) -> int:
        """Bytes the reader holds: hiredis lets go of read ones in chunks, not at once."""
        return int(self._reader.len())

    def reply(self) -> tuple[bool, Any]:
        """``(True, reply)`` once a whole reply was fed, else ``(False, None)``."""
        gets, push = self._reader.gets, self._push
        while True:
            value = gets()
            if value is _MORE:
                return False, None
            if type(value) is not push:  # an out-of-band push: not the reply
                if self._fed > _FRESH_AFTER and not self._reader.len():
                    self._reader, self._fed = _new_reader(), 0  # see _FRESH_AFTER
                return True, value

    def whole_replies(self, most: int) -> list[Any]:
        """Up to ``most`` replies that are whole in what was fed; fewer, maybe none."""
        replies: list[Any] = []
        while len(replies) < most:
            done, value = self.reply()
            if not done:
                break
            replies.append(value)
        return replies


def _new_reader() -> Any:
    return hiredis.Reader(
        protocolError=ProtocolError, replyError=BaseParser.parse_error, notEnoughData=_MORE
    )


def new_parser() -> Parser:
    """A parser for one connection's replies: hiredis's when redis-py uses it."""
    return HiredisParser() if USE_HIREDIS else ReplyParser()
