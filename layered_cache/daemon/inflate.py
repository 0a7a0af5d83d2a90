"""A fetched batch's records decompressed within a cap, not whatever size they claim.

aiokafka decompresses a whole batch in memory inside ``getmany``, however large it comes
out: a 256 KiB zstd batch of RLE blocks inflates to 8 GiB, and the daemon died on the
allocation (an abort, the OOM killer), again at every restart, its partition stalled.
The daemon's consumer decompresses each v2 batch itself first (``header_names``), the
same decoders aiokafka uses but bounded, and hands aiokafka the batch uncompressed:
past the cap the batch is a ``CorruptRecordException``, set aside as an unreadable
record (``unreadable``), and the partition moves on.

Bounded per codec: gzip is read as a stream, at most one byte past the cap; snappy
blocks declare their size before a byte is decompressed; lz4 and zstd are written into
an anonymous mapping of the cap's size, whose pages the kernel hands out only as they
are written, and cramjam stops at its end.
"""

from __future__ import annotations

import gzip
import io
import mmap
import struct
from typing import Any

import cramjam
from aiokafka import codec
from aiokafka.errors import CorruptRecordException, UnsupportedCodecError

__all__ = ["inflate"]

_GZIP, _SNAPPY, _LZ4, _ZSTD = 1, 2, 3, 4  # a batch's codec bits (attributes & 0x07)
_XERIAL = b"\x82SNAPPY\x00"  # the 16-byte header aiokafka's ``snappy_decode`` looks for,
_XERIAL_V1 = struct.pack("!ii", 1, 1)  # then its version and the version it reads with


def inflate(codec_id: int, body: bytes, cap: int) -> bytes:
    """``body`` as aiokafka's decoder for ``codec_id`` decompresses it, or a
    ``CorruptRecordException`` once that would pass ``cap`` bytes. Any other error of
    a decoder is raised as it is (``header_names._decoding`` makes it a record's)."""
    if codec_id == _GZIP:
        with gzip.GzipFile(fileobj=io.BytesIO(body), mode="rb") as stream:
            records = stream.read(cap + 1)
        return _within(records, cap, "gzip")
    if codec_id == _SNAPPY:
        _within_declared(_snappy_sizes(body), cap)
        return bytes(codec.snappy_decode(body))  # each block exactly as long as declared
    if codec_id in (_LZ4, _ZSTD):
        name = "lz4" if codec_id == _LZ4 else "zstd"
        return _within(_into_mapping(getattr(cramjam, name), body, cap), cap, name)
    raise UnsupportedCodecError(f"Unknown compression codec {codec_id:#04x}")


def _into_mapping(module: Any, body: bytes, cap: int) -> bytes:
    """``module.decompress_into`` a mapping one byte past ``cap``: cramjam raises once
    the output would not fit (``failed to write whole buffer``)."""
    with mmap.mmap(-1, cap + 1) as out:
        try:
            written = int(module.decompress_into(body, out))
        except cramjam.DecompressionError as exc:
            raise CorruptRecordException(
                f"batch not decompressed within {cap} bytes: {exc}"
            ) from exc
        return out[:written]


def _snappy_sizes(body: bytes) -> list[int]:
    """The sizes snappy's blocks declare, walked as aiokafka's ``snappy_decode`` walks
    them: in xerial framing (a 16-byte header, then blocks each after its 4-byte
    length), or one raw block. A block length that is negative or runs past the end is
    a corrupt batch (aiokafka's decoder fails on the slice it takes then)."""
    if not (len(body) > 16 and body[:8] == _XERIAL and body[8:16] == _XERIAL_V1):
        return [int(cramjam.snappy.decompress_raw_len(body))]
    sizes = []
    cursor = 16
    while cursor < len(body):
        (length,) = struct.unpack_from("!i", body, cursor)
        cursor += 4
        if not 0 <= length <= len(body) - cursor:
            raise CorruptRecordException(f"snappy block of {length} bytes at {cursor}")
        sizes.append(int(cramjam.snappy.decompress_raw_len(body[cursor : cursor + length])))
        cursor += length
    return sizes


def _within_declared(sizes: list[int], cap: int) -> None:
    if sum(sizes) > cap:
        raise CorruptRecordException(f"snappy batch declares {sum(sizes)} bytes, over {cap}")


def _within(records: bytes, cap: int, name: str) -> bytes:
    if len(records) > cap:
        raise CorruptRecordException(f"{name} batch inflates past {cap} bytes")
    return records
