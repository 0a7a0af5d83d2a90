"""The backplane stream's replies as the listener reads them (``_stream``), on a real
Redis in both protocols: RESP3 (redis-py 8's default) and RESP2 (what a relay speaks,
and what ``?protocol=2`` asks for), read the way the listener reads them (on a held
connection, ``_direct.HeldConnection``)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from layered_cache import _direct as direct
from layered_cache._stream import xread_entries


@pytest.mark.parametrize("protocol", [2, 3])
async def test_an_xread_reply_gives_the_same_entries_in_resp2_and_resp3(
    redis_url: str, prefix: str, protocol: int
) -> None:
    client = aioredis.Redis.from_url(redis_url, protocol=protocol)
    held = direct.HeldConnection(client)
    stream = f"{prefix}stream"
    try:
        first = await client.xadd(stream, {"origin": b"a", "keys": b"\x91\xa1k"})
        second = await client.xadd(stream, {"origin": b"b"})
        reply = await held.execute(
            "XREAD", "COUNT", 10, "BLOCK", 10, "STREAMS", stream, "0-0"
        )
        assert xread_entries(reply) == [
            (first, {b"origin": b"a", b"keys": b"\x91\xa1k"}),
            (second, {b"origin": b"b"}),
        ]
        # A block that timed out: nil in both protocols, no entries.
        nothing = await held.execute(
            "XREAD", "COUNT", 10, "BLOCK", 10, "STREAMS", stream, second
        )
        assert xread_entries(nothing) == []
    finally:
        await held.close()
        await client.aclose()


def test_an_entry_without_fields_reads_as_empty() -> None:
    assert xread_entries([[b"s", [[b"1-0", None]]]]) == [(b"1-0", {})]
    assert xread_entries({b"s": [[b"1-0", []]]}) == [(b"1-0", {})]
