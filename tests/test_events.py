"""Event decoding and routing: what becomes keys, and why the rest is poison."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from layered_cache import ConfigError, parse_config
from layered_cache._config import Config
from layered_cache._events import (
    BookPriceChanged,
    CacheInvalidate,
    EventDecoder,
    PoisonEvent,
    Target,
    encode_event,
    unique_targets,
)
from layered_cache._policy import compile_policy


def config(events: list[dict[str, Any]] | None = None, **kafka: Any) -> Config:
    raw: dict[str, Any] = {
        "redis": {"prefix": "env:"},
        "kafka": kafka,
        "namespaces": {
            "book": {"key": "book:{id}", "hot": {"replicas": 8}},
            "author": {"key": "author:{id}"},
            "shelf": {"key": "shelf:{store}:{id}"},
        },
        "events": events
        if events is not None
        else [
            {
                "type": "BookPriceChanged",
                "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}],
            }
        ],
    }
    return parse_config(raw, env={})


def poison_reason(decoder: EventDecoder, data: bytes | None) -> str:
    with pytest.raises(PoisonEvent) as info:
        decoder.decode(data)
    return info.value.reason


def test_book_price_changed_invalidates_the_book_with_its_replicas() -> None:
    event = BookPriceChanged(42, "12.90", "9.90", "2026-11-29T10:00:00Z")
    data = encode_event(event)
    assert msgspec.json.decode(data)["type"] == "BookPriceChanged"
    decoded = EventDecoder(config()).decode(data)
    assert decoded.event_type == "BookPriceChanged"
    assert decoded.targets == [Target("book", "env:book:42", 8)]


def test_a_new_event_type_needs_only_config_and_may_fan_out() -> None:
    routes = [
        {
            "type": "BookMoved",
            "invalidate": [
                {"namespace": "book", "key": {"id": "book.id"}},  # nested field
                {"namespace": "shelf", "key": {"store": "store", "id": "to_shelf"}},
                {"namespace": "shelf", "key": {"store": "store", "id": "from_shelf"}},
            ],
        }
    ]
    data = b'{"type":"BookMoved","book":{"id":7},"store":"berlin","from_shelf":"a1","to_shelf":3}'
    targets = EventDecoder(config(routes)).decode(data).targets
    assert [t.key for t in targets] == ["env:book:7", "env:shelf:berlin:3", "env:shelf:berlin:a1"]
    assert [t.replicas for t in targets] == [8, 0, 0]


def test_generic_cache_invalidate_needs_no_route() -> None:
    data = encode_event(CacheInvalidate("author", [{"id": 1}, {"id": "x-2"}]))
    targets = EventDecoder(config([])).decode(data).targets
    assert targets == [Target("author", "env:author:1", 0), Target("author", "env:author:x-2", 0)]


def test_unrouted_fields_are_not_checked() -> None:
    """Deleting a key is always safe: a producer's extra or missing metadata must not
    stop it (only the fields that build keys are strict)."""
    decoder = EventDecoder(config())
    assert decoder.decode(b'{"type":"BookPriceChanged","book_id":"isbn-1","extra":[1]}').targets


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (None, "empty message"),
        (b"", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b'{"type": "BookPriceChanged", "book_id": 1', "not JSON"),
        (b"[1, 2]", "not a JSON object but list"),
        (b'"hello"', "not a JSON object but str"),
        (b'{"book_id": 1}', "missing or non-string 'type'"),
        (b'{"type": 5}', "missing or non-string 'type'"),
        (b'{"type": "AuthorRenamed"}', "unknown event type 'AuthorRenamed'"),
        (b'{"type": "BookPriceChanged"}', "missing field 'book_id'"),
        (b'{"type": "BookPriceChanged", "book_id": 1.5}', "must be an int or str, got float"),
        (b'{"type": "BookPriceChanged", "book_id": true}', "must be an int or str, got bool"),
        (b'{"type": "BookPriceChanged", "book_id": null}', "must be an int or str, got NoneType"),
        (b'{"type": "BookPriceChanged", "book_id": {"a": 1}}', "got dict"),
        (b'{"type": "BookPriceChanged", "book_id": "a b"}', "not a safe key value"),
        (b'{"type": "BookPriceChanged", "book_id": "{x}"}', "not a safe key value"),
        (b'{"type": "BookPriceChanged", "book_id": "a#1"}', "not a safe key value"),
        (b'{"type": "BookPriceChanged", "book_id": ""}', "not a safe key value"),
        (b'{"type": "CacheInvalidate", "namespace": "nope", "keys": []}', "unknown namespace"),
        (b'{"type": "CacheInvalidate", "namespace": "book"}', "missing required field"),
        (
            b'{"type": "CacheInvalidate", "namespace": "book", "keys": [{"idx": 1}]}',
            "missing key field 'id'",
        ),
        (
            b'{"type": "CacheInvalidate", "namespace": "book", "keys": [{"id": 1.0}]}',
            "CacheInvalidate",
        ),
    ],
)
def test_poison_events_are_rejected_with_a_reason(data: bytes | None, reason: str) -> None:
    assert reason in poison_reason(EventDecoder(config()), data)


def test_oversized_payload_is_rejected_before_parsing() -> None:
    decoder = EventDecoder(config(max_event_bytes=1000))
    big = b'{"type": "BookPriceChanged", "book_id": 1, "pad": "' + b"x" * 1000 + b'"}'
    assert "exceeds max_event_bytes 1000" in poison_reason(decoder, big)
    assert "exceeds" in poison_reason(decoder, b"x" * 2000)  # not even looked at


def test_routing_cache_invalidate_or_one_type_twice_is_refused_at_load() -> None:
    route = {"type": "CacheInvalidate", "invalidate": [{"namespace": "book", "key": {"id": "x"}}]}
    with pytest.raises(ConfigError, match=r"events\[0\]\.type: 'CacheInvalidate' is built in"):
        config([route])
    twice = {"type": "T", "invalidate": [{"namespace": "book", "key": {"id": "x"}}]}
    with pytest.raises(ConfigError, match=r"events\[1\]\.type: 'T' is already routed"):
        config([twice, twice])


def test_a_batch_invalidates_each_key_once() -> None:
    targets = [Target("book", "b:1", 8), Target("book", "b:2", 8), Target("book", "b:1", 8)]
    assert unique_targets(targets) == [("b:1", 8), ("b:2", 8)]


def test_typed_event_round_trips_for_producers() -> None:
    event = BookPriceChanged(42, "12.90", "9.90", "2026-11-29T10:00:00Z")
    assert msgspec.json.decode(encode_event(event), type=BookPriceChanged) == event


def test_events_build_the_same_encoded_names_as_the_cache() -> None:
    """The daemon deletes exactly the name the cache wrote, ':' in values included."""
    cfg = config()
    data = msgspec.json.encode(
        {"type": "CacheInvalidate", "namespace": "shelf", "keys": [{"store": "a:b", "id": "c"}]}
    )
    [target] = EventDecoder(cfg).decode(data).targets
    template = compile_policy("shelf", cfg.namespaces["shelf"], "env:").template
    assert target.key == template.build({"store": "a:b", "id": "c"}) == "env:shelf:a%3Ab:c"
    other = {"store": "a", "id": "b:c"}
    assert template.build(other) != target.key
