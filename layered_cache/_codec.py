"""The L2 value format: one msgspec (MessagePack) envelope per Redis value.

The envelope carries what the read path needs besides the value itself: when it was
written, its soft expiry (past it the value is stale but may still be served by the
fail-safe), and how long its load took (XFetch's delta). Decoding is typed: a namespace
that declares a value type gets instances of it back. Nothing is ever unpickled, so a
poisoned Redis cannot run code; bytes that do not decode are reported as ``CodecError``
and the read path treats them as a miss.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
import msgspec.inspect

__all__ = [
    "ENVELOPE_FORMAT", "MAX_TAGS", "UNDECODABLE", "Codec", "CodecError", "Envelope", "EnvelopeMeta",
    "same_type",
]

T = TypeVar("T")

ENVELOPE_FORMAT: Literal[1] = 1

# Tags one entry may carry (``_tags.entry_tags`` refuses more on write). Checked while
# decoding, from the map's header: an envelope planted with 200,000 tags took ~26 ms
# to decode before its count was looked at; with the bound, ~0.02 ms to refuse.
MAX_TAGS = 1_000
Tags = Annotated[dict[str, str], msgspec.Meta(max_length=MAX_TAGS)]
# A time or a duration: NaN (every comparison false) made a planted envelope fresh for
# get() and stale for get_or_load(), and an early refresh retry on every read; infinity
# an entry that never goes stale. Bounds far past any real time refuse both.
Finite = Annotated[float, msgspec.Meta(ge=-1e300, le=1e300)]

# What decoding bytes from Redis (or the backplane) may raise: msgspec's errors, and
# RecursionError for a value nested deeper than the interpreter's stack (~1 KB of
# "[[[[..."). Each means "not ours": a miss, counted, never an exception out of a read.
UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def _refuse_extension(code: int, data: memoryview) -> Any:
    """The encoder writes no msgpack extension of its own (msgspec's timestamp, for a
    datetime, is decoded before any hook): one in a value was planted by another
    writer. Decoded as ``msgspec.msgpack.Ext``, it was served to callers of an undeclared
    namespace as an object no JSON renders; now the envelope is not ours, a miss."""
    raise msgspec.ValidationError(f"msgpack extension type {code}: not written by layered_cache")


class CodecError(ValueError):
    """Bytes in Redis that are not a valid envelope of the expected value type."""


class Envelope(msgspec.Struct, Generic[T], array_like=True, frozen=True):
    """``[1, value, written_at, soft_expiry, delta]`` on the wire (array_like: compact),
    plus ``{tag: version}`` for a tagged entry (omitted when untagged: the untagged wire
    format is unchanged)."""

    format: Literal[1]
    value: T
    written_at: Finite  # Redis' clock (``_redisclock``): one time scale for every host
    soft_expiry: Finite  # Redis' clock; past it the value is stale
    delta: Finite  # seconds the load took: XFetch's delta
    # tag -> its version when the entry was loaded. The names are not checked here (a
    # regex per tag: 8 µs of a 20-tag page's L2 hit): the tags this instance holds
    # versions of were checked when it fetched them, and an unknown one is checked
    # before its fetch (``TagVersions.valid``), so an envelope planted with a tag no
    # caller could give is a dead entry, a miss that the next fill repairs.
    tags: Tags | None = None


class EnvelopeMeta(msgspec.Struct, array_like=True, frozen=True):
    """The envelope without decoding the value: for inspection tools."""

    format: Literal[1]
    value: msgspec.Raw
    written_at: Finite
    soft_expiry: Finite
    delta: Finite
    tags: Tags | None = None


class Codec(Generic[T]):
    """Encodes/decodes envelopes for one namespace's value type (``Any`` if undeclared)."""

    __slots__ = ("_decoder", "_encoder", "value_type")

    def __init__(self, value_type: Any = Any) -> None:
        self.value_type = value_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Envelope[T]] = msgspec.msgpack.Decoder(
            Envelope[value_type], ext_hook=_refuse_extension
        )

    def encode(
        self,
        value: T,
        written_at: float,
        soft_expiry: float,
        delta: float,
        tags: dict[str, str] | None = None,
    ) -> bytes:
        """Raises ``TypeError`` for values msgspec cannot encode. Written as a tuple: an
        untagged envelope stays 5 elements long (readers of the format before tags
        decode it), a tagged one gets the tags as a 6th."""
        if tags:
            return self._encoder.encode(
                (ENVELOPE_FORMAT, value, written_at, soft_expiry, delta, tags)
            )
        return self._encoder.encode((ENVELOPE_FORMAT, value, written_at, soft_expiry, delta))

    def decode(self, data: bytes) -> Envelope[T]:
        try:
            return self._decoder.decode(data)
        except UNDECODABLE as exc:
            raise CodecError(str(exc)) from None
        except Exception as exc:
            # The declared type's own code refused the value: a ``__post_init__`` added
            # since an older deploy wrote it, raising an error of its own (msgspec wraps
            # only TypeError and ValueError). As undecodable as any: a miss, reloaded
            # and overwritten, not an exception out of every read for the L2 TTL.
            raise CodecError(f"{type(exc).__name__}: {exc}") from None


def same_type(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` decode alike: ``list[Book]`` and ``typing.List[Book]``,
    ``int | None`` and ``Optional[int]`` are one type spelled two ways (a code base half
    through pyupgrade has both), which ``==`` tells apart. Compared as msgspec sees them."""
    if a == b:
        return True
    try:
        return bool(msgspec.inspect.type_info(a) == msgspec.inspect.type_info(b))
    except (TypeError, ValueError):  # not a type msgspec knows: only equal is the same
        return False


_META_DECODER = msgspec.msgpack.Decoder(EnvelopeMeta)


def decode_meta(data: bytes) -> EnvelopeMeta:
    try:
        return _META_DECODER.decode(data)
    except UNDECODABLE as exc:
        raise CodecError(str(exc)) from None
