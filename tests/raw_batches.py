"""Record batches written byte by byte (Kafka's v2 format), for producers aiokafka can't
imitate: a Go or C client, a buggy or hostile one. The broker (tansu) stores them as
they come, with a valid CRC."""

from __future__ import annotations

import struct

from aiokafka import AIOKafkaProducer
from aiokafka.record.util import calc_crc32c, encode_varint

Header = tuple[bytes, "bytes | int | None"]


def varint(n: int) -> bytes:
    out = bytearray()
    encode_varint(n, out.append)
    return bytes(out)


def record(offset_delta: int, key: bytes | None, value: bytes | None, headers: list[Header]) -> bytes:
    """One v2 record; a header whose value is an int is a length with no bytes behind it."""
    body = bytearray(b"\x00")  # attributes
    body += varint(0)  # timestamp delta
    body += varint(offset_delta)
    body += varint(-1) if key is None else varint(len(key)) + key
    body += varint(-1) if value is None else varint(len(value)) + value
    body += varint(len(headers))
    for name, header_value in headers:
        body += varint(len(name)) + name
        if isinstance(header_value, int):
            body += varint(header_value)
        elif header_value is None:
            body += varint(-1)
        else:
            body += varint(len(header_value)) + header_value
    return varint(len(body)) + bytes(body)


def batch(records: list[bytes], *, codec: int = 0, body: bytes | None = None, count: int = 0) -> bytes:
    """A v2 batch of ``records`` (uncompressed), its CRC-32C right; or, with ``body``,
    a batch of ``count`` records whose (compressed) records section is ``body`` as is."""
    timestamp = 1_700_000_000_000
    count = count or len(records)
    after_crc = (
        struct.pack(">hiqqqhii", codec, count - 1, timestamp, timestamp, -1, -1, -1, count)
        + (b"".join(records) if body is None else body)
    )
    head = struct.pack(">ibI", -1, 2, calc_crc32c(after_crc))
    return struct.pack(">qi", 0, len(head) + len(after_crc)) + head + after_crc


async def send_raw(producer: AIOKafkaProducer, topic: str, partition: int, data: bytes) -> None:
    """``data`` (one batch) as it is, through the producer's batch interface."""
    built = producer.create_batch()
    built.append(key=None, value=b"placeholder", timestamp=None)
    built.close()
    built._buffer = bytearray(data)  # what _build() returns: sent as it is
    await (await producer.send_batch(built, topic, partition=partition))
