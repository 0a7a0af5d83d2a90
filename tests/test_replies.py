"""``_replies.ReplyParser``: a reply parses to the same value however its bytes arrive
(whole, byte by byte, split anywhere), replies fed together come out one at a time, an
out-of-band push is skipped, and bytes that are not a reply raise ``ProtocolError``
(a ``RedisError``: the listener reconnects) instead of being guessed at."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import NoScriptError, RedisError, ResponseError

from layered_cache._replies import ProtocolError, ReplyParser

# An XREAD reply in RESP3 (a map: stream -> entries) with two entries, then RESP2's.
XREAD_RESP3 = (
    b"%1\r\n$6\r\nstream\r\n*2\r\n"
    b"*2\r\n$3\r\n1-0\r\n*4\r\n$4\r\nkeys\r\n$3\r\n\x91\xa1k\r\n$6\r\norigin\r\n$1\r\na\r\n"
    b"*2\r\n$3\r\n2-0\r\n*2\r\n$6\r\norigin\r\n$0\r\n\r\n"
)
XREAD_RESP2 = XREAD_RESP3.replace(b"%1\r\n", b"*1\r\n*2\r\n", 1)
ENTRIES = [
    [b"1-0", [b"keys", b"\x91\xa1k", b"origin", b"a"]],
    [b"2-0", [b"origin", b""]],
]


def parse_all(*pieces: bytes) -> list[Any]:
    """Feed ``pieces`` one after another; every reply that completes, in order."""
    parser, replies = ReplyParser(), []
    for piece in pieces:
        parser.feed(piece)
        while True:
            done, reply = parser.reply()
            if not done:
                break
            replies.append(reply)
    return replies


def test_an_xread_reply_parses_the_same_in_resp2_and_resp3() -> None:
    assert parse_all(XREAD_RESP3) == [{b"stream": ENTRIES}]
    assert parse_all(XREAD_RESP2) == [[[b"stream", ENTRIES]]]


@pytest.mark.parametrize("reply", [XREAD_RESP3, XREAD_RESP2])
def test_a_reply_split_anywhere_or_fed_byte_by_byte_parses_the_same(reply: bytes) -> None:
    whole = parse_all(reply)
    assert parse_all(*(reply[i : i + 1] for i in range(len(reply)))) == whole
    for cut in range(len(reply) + 1):
        assert parse_all(reply[:cut], reply[cut:]) == whole, cut


def test_a_block_that_timed_out_is_null_in_both_protocols() -> None:
    assert parse_all(b"_\r\n", b"*-1\r\n", b"$-1\r\n") == [None, None, None]


def test_replies_fed_together_come_out_one_at_a_time() -> None:
    assert parse_all(b"+OK\r\n:42\r\n$2\r\nhi\r\n*0\r\n%0\r\n") == [b"OK", 42, b"hi", [], {}]


def test_every_scalar_kind_reads_as_redis_py_reads_it() -> None:
    replies = parse_all(b"#t\r\n#f\r\n,1.5\r\n(12345678901234567890\r\n=8\r\ntxt:abcd\r\n")
    assert replies == [True, False, 1.5, 12345678901234567890, b"abcd"]


def test_an_error_reply_is_redis_pys_exception_for_its_code() -> None:
    noscript, wrongtype = parse_all(b"-NOSCRIPT No matching script\r\n-WRONGTYPE bad\r\n")
    assert isinstance(noscript, NoScriptError)
    assert isinstance(wrongtype, ResponseError)
    assert "WRONGTYPE" in str(wrongtype)


def test_an_out_of_band_push_before_the_reply_is_skipped() -> None:
    push = b">3\r\n$6\r\nMOVING\r\n:1\r\n$9\r\nhost:6379\r\n>0\r\n"
    assert parse_all(push + XREAD_RESP3) == [{b"stream": ENTRIES}]
    # A push inside a reply is part of it (not out of band): kept as a list.
    assert parse_all(b"*1\r\n>1\r\n:1\r\n") == [[[1]]]


@pytest.mark.parametrize(
    "garbage",
    [
        b"?what\r\n",  # no such type
        b"$abc\r\n",  # a length that is no number
        b"*x\r\n",
        b"$-2\r\n",  # only -1 is a null
        b"*-7\r\n",
        b":12a\r\n",
        b"$3\r\nabcXY",  # a bulk string not followed by CRLF
        b",nope\r\n",
    ],
)
def test_bytes_that_are_not_a_reply_raise_a_protocol_error(garbage: bytes) -> None:
    parser = ReplyParser()
    parser.feed(garbage)
    with pytest.raises(ProtocolError):
        parser.reply()
    assert issubclass(ProtocolError, RedisError)


def test_an_incomplete_reply_asks_for_more_and_keeps_what_it_had() -> None:
    parser = ReplyParser()
    parser.feed(b"*2\r\n$5\r\nhel")
    assert parser.reply() == (False, None)
    parser.feed(b"lo\r\n:7")
    assert parser.reply() == (False, None)
    parser.feed(b"\r\n")
    assert parser.reply() == (True, [b"hello", 7])


# -- any reply tree, encoded, split at random points -----------------------------------

_scalars = st.one_of(
    st.binary(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.none(),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.binary(max_size=8), inner, max_size=4),
    ),
    max_leaves=30,
)


def _encode(value: Any) -> bytes:
    """RESP3 as a server writes it (the test's own encoder, independent of the parser)."""
    if value is None:
        return b"_\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%b\r\n" % (len(value), value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, dict):
        pairs = b"".join(_encode(k) + _encode(v) for k, v in value.items())
        return b"%%%d\r\n" % len(value) + pairs
    return b"*%d\r\n" % len(value) + b"".join(_encode(item) for item in value)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_values, min_size=1, max_size=3), data=st.data())
def test_any_replies_split_at_any_points_parse_back_to_themselves(
    values: list[Any], data: st.DataObject
) -> None:
    stream = b"".join(_encode(value) for value in values)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert parse_all(*pieces) == values


def _outcome(pieces: list[bytes]) -> tuple[str, Any]:
    """What parsing ``pieces`` gives: the replies (an error reply's exception by its
    repr: two instances never compare equal), or the error's type and text."""
    try:
        return "replies", repr(parse_all(*pieces))
    except Exception as exc:
        return type(exc).__name__, str(exc)


_PIECES = [b"*", b"%", b"~", b">", b"$", b":", b"+", b"-", b"_", b",", b"#", b"(", b"=",
           b"1", b"2", b"-1", b"-3", b"0", b"x", b"\r\n", b"\r", b"ERR no"]


@settings(max_examples=500, deadline=None)
@given(
    values=st.lists(_values, min_size=1, max_size=2),
    cut=st.integers(0, 10_000),
    junk=st.lists(st.sampled_from(_PIECES), max_size=6),
)
def test_a_reply_read_whole_and_one_read_byte_by_byte_agree_even_when_broken(
    values: list[Any], cut: int, junk: list[bytes]
) -> None:
    """A reply that arrived whole takes a one-pass reader (``_whole``), a split one the
    element-by-element parser: on any bytes, valid or truncated and followed by junk,
    both give the same replies or the same error."""
    stream = b"".join(_encode(value) for value in values)
    stream = stream[: cut % (len(stream) + 1)] + b"".join(junk)
    whole = _outcome([stream])
    assert whole == _outcome([stream[i : i + 1] for i in range(len(stream))])


def test_a_reply_nested_deeper_than_the_stack_is_read_all_the_same() -> None:
    depth = 5_000
    (value,) = parse_all(b"*1\r\n" * depth + b":7\r\n")
    for _ in range(depth):  # walked down, not compared: ``==`` would recurse too
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == 7


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_values, min_size=1, max_size=6), data=st.data())
def test_replies_taken_many_at_a_time_are_the_replies_taken_one_at_a_time(
    values: list[Any], data: st.DataObject
) -> None:
    """A transaction's replies are taken with ``whole_replies`` while they are whole in
    the buffer and with ``reply()`` where one was split (``_direct``): any split gives
    the same replies in the same order, and nothing more than asked for."""
    stream = b"".join(_encode(value) for value in values)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    parser, replies = ReplyParser(), []
    for piece in pieces:
        parser.feed(piece)
        while len(replies) < len(values):
            most = data.draw(st.integers(1, len(values) - len(replies)))
            taken = parser.whole_replies(most)
            assert len(taken) <= most
            replies += taken
            if taken:
                continue
            done, reply = parser.reply()
            if not done:
                break
            replies.append(reply)
    assert replies == values
    assert parser.whole_replies(5) == [] and parser.reply() == (False, None)


def test_whole_replies_stop_at_one_that_is_split_and_reply_resumes_it() -> None:
    parser = ReplyParser()
    parser.feed(b"+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n")
    assert parser.whole_replies(5) == [b"QUEUED", b"QUEUED"]
    assert parser.reply() == (False, None)  # the array is open now
    assert parser.whole_replies(5) == []
    parser.feed(b":3\r\n+QUEUED\r\n")
    assert parser.reply() == (True, [b"OK", 3])
    assert parser.whole_replies(5) == [b"QUEUED"]


def test_a_push_among_a_transactions_replies_is_skipped_not_counted() -> None:
    """RESP3 pushes (client tracking, maintenance notices) may arrive between a
    transaction's replies: ``whole_replies`` stops at one and ``reply()`` skips it, so
    the replies counted are the transaction's own, and the next command's stays."""
    parser = ReplyParser()
    push = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$3\r\nfoo\r\n"
    parser.feed(b"+OK\r\n" + push + b"+QUEUED\r\n" + push + b"*1\r\n+OK\r\n+PONG\r\n")
    replies = parser.whole_replies(3)
    while len(replies) < 3:
        done, reply = parser.reply()
        assert done
        replies.append(reply)
        replies += parser.whole_replies(3 - len(replies))
    assert replies == [b"OK", b"QUEUED", [b"OK"]]
    assert parser.reply() == (True, b"PONG")
