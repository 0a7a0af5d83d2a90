"""The typed invalidation events producers send, and their JSON form.

One event is one JSON object per Kafka message, tagged by ``type`` (``_events`` decodes
and routes them). Prices are decimal strings, never floats: money.
"""

from __future__ import annotations

import msgspec

__all__ = ["CACHE_INVALIDATE", "BookPriceChanged", "CacheInvalidate", "encode_event"]

CACHE_INVALIDATE = "CacheInvalidate"


class BookPriceChanged(msgspec.Struct, tag="BookPriceChanged", tag_field="type", frozen=True):
    """Catalog changed a book's price. Prices are decimal strings (never floats: money)."""

    book_id: int
    old_price: str
    new_price: str
    occurred_at: str


class CacheInvalidate(msgspec.Struct, tag=CACHE_INVALIDATE, tag_field="type", frozen=True):
    """Generic invalidation: any namespace, any keys, no route needed."""

    namespace: str
    keys: list[dict[str, int | str]]


_encoder = msgspec.json.Encoder()


def encode_event(event: msgspec.Struct) -> bytes:
    """JSON bytes of a typed event, ``type`` tag included (for producers and tests)."""
    return _encoder.encode(event)
