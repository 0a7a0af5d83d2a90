"""The commands a backplane relay takes from its clients, checked before it acts on them:
XREAD's arguments (one stream, ours), and the listener's other commands, the only ones
it forwards to Redis.
"""

from __future__ import annotations

import re

from layered_cache._resp import encode_error

__all__ = ["refused_forward", "xread_arguments"]

_LARGEST = 2**63 - 1  # COUNT and BLOCK, as Redis parses them (a long long)
# As Redis reads them: ASCII digits only (Python's int() also takes "+3", "1_0" and
# other scripts' digits, where Redis answers an error).
_INTEGER = re.compile(rb"0|-?[1-9][0-9]*")  # no leading zeros, no "-0" (string2ll)
_STREAM_ID = re.compile(rb"\+?([0-9]+)(?:-\+?([0-9]+))?")  # string2ull takes a "+"
_ORIGIN = re.compile(rb"[0-9a-zA-Z_.:-]{1,64}")  # an instance ID (or "-"), nothing more


def xread_arguments(
    arguments: list[bytes], stream: bytes
) -> tuple[int | None, int | None, bytes]:
    """``[COUNT n] [BLOCK ms] STREAMS <our stream> <id>``: count, block, id."""
    count = block = None
    upper = [argument.upper() for argument in arguments]
    if b"STREAMS" not in upper:
        raise ValueError("syntax error")
    streams = upper.index(b"STREAMS")
    options, rest = upper[:streams], arguments[streams + 1 :]
    if len(rest) != 2 or rest[0] != stream:
        raise ValueError(f"the relay serves one stream, {stream.decode()!r}")
    for index in range(0, len(options) - 1, 2):
        option, value = options[index], _integer(options[index + 1])
        if option == b"COUNT":
            count = value if value > 0 else None  # Redis: COUNT <= 0 is no limit
        elif option == b"BLOCK" and value >= 0:
            block = value
        elif option == b"BLOCK":
            raise ValueError("timeout is negative")
        else:
            raise ValueError("syntax error")
    if len(options) % 2:
        raise ValueError("syntax error")
    if rest[1] != b"$":
        _check_id(rest[1])
    return count, block, rest[1]


def _integer(text: bytes) -> int:
    if not _INTEGER.fullmatch(text):
        raise ValueError("value is not an integer or out of range")
    value = int(text)
    if not -_LARGEST - 1 <= value <= _LARGEST:
        raise ValueError("value is not an integer or out of range")
    return value


def _check_id(entry_id: bytes) -> None:
    """An ID as Redis takes it in XREAD: ``ms`` or ``ms-seq``, each below 2^64."""
    match = _STREAM_ID.fullmatch(entry_id)
    if match is None or any(part and int(part) >= 2**64 for part in match.groups()):
        raise ValueError("Invalid stream ID specified as stream command argument")


def refused_forward(command: list[bytes], stream: bytes) -> bytes | None:
    """The error for any command to forward but the listener's own three: its start
    marker (``XADD <stream> * origin <id>``: a relay port must not let a client trim the
    stream with ``MAXLEN 0``, move its IDs ahead, or forge entries), its start position
    (``XREVRANGE <stream> + - COUNT 1``) and its gap check (``XINFO STREAM <stream>``).
    Anything wider (``XRANGE - +``, ``XINFO ... FULL``) would have the relay parse and
    re-encode the whole stream, up to ``maxlen`` entries, for any client of its port."""
    name, rest = command[0].upper(), [argument.upper() for argument in command[1:]]
    if name == b"XADD" and len(rest) == 4 and command[1:3] == [stream, b"*"]:
        # The field exactly as listeners compare it: "ORIGIN" is another field, and an
        # entry of another format clears every L1 (``BackplaneListener._read_once``).
        allowed = command[3] == b"origin" and _ORIGIN.fullmatch(command[4]) is not None
    elif name == b"XREVRANGE":
        allowed = rest[2:] == [b"-", b"COUNT", b"1"] and command[1:3] == [stream, b"+"]
    elif name == b"XINFO":
        allowed = len(rest) == 2 and rest[0] == b"STREAM" and command[2] == stream
    else:
        allowed = False
    if allowed:
        return None
    return encode_error(
        "ERR the backplane relay forwards only XADD <stream> * origin <id>, "
        "XREVRANGE <stream> + - COUNT 1 and XINFO STREAM <stream>"
    )
