"""Event decoding and routing: what becomes keys, and why the rest is poison."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from layered_cache import ConfigError, parse_config
from layered_cache._config import Config
from layered_cache._event_types import BookPriceChanged, CacheInvalidate, encode_event
from layered_cache._events import EventDecoder, PoisonEvent, Target
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


def test_a_cache_invalidate_key_naming_more_fields_invalidates_the_entry_the_named_ones_build(
) -> None:
    """The cache refuses a field its template doesn't name, so the named fields' entry is
    the only one such a key can mean; set aside as poison, its invalidation was lost."""
    data = encode_event(CacheInvalidate("author", [{"id": 1, "lang": "fr"}]))
    targets = EventDecoder(config([])).decode(data).targets
    assert targets == [Target("author", "env:author:1", 0)]


@pytest.mark.parametrize(
    "row",
    [{"id": 7, "price": 9.9}, {"id": 7, "deleted_at": None}, {"id": 7, "in_stock": True},
     {"id": 7, "meta": {"lang": "fr"}}],
    ids=["float", "null", "bool", "object"],
)
def test_a_cache_invalidate_key_carrying_the_changed_row_invalidates_its_entry(
    row: dict[str, Any],
) -> None:
    """docs/daemon.md: a key "with members the template doesn't name ... invalidates the
    entry the named ones build". A producer sending the row it changed ({"id": 7,
    "price": 9.9}) had the whole event dead-lettered ("Expected `int | str`, got
    `float`"): every member was type-checked, the unnamed ones too; book:7 stayed."""
    data = msgspec.json.encode({"type": "CacheInvalidate", "namespace": "book", "keys": [row]})
    decoder = EventDecoder(config([]))
    assert decoder.decode(data).targets == [Target("book", "env:book:7", 8)]
    keys: dict[str, int] = {}
    assert decoder.collect(data, keys, []) == "CacheInvalidate" and keys == {"env:book:7": 8}


def test_an_event_missing_its_tag_field_is_poison_named_by_its_type() -> None:
    """docs/daemon.md: `dlq.event.type` is "the event's `type`, when it had one". An event
    routed to a tag and missing the tag's field had none (and its reason no type)."""
    from tests.helpers import make_config

    routed = make_config(
        "redis://127.0.0.1:1", "p:",
        events=[{"type": "AuthorRenamed", "invalidate": [{"tag": "author:{author.id}"}]}],
    )
    with pytest.raises(PoisonEvent) as info:
        EventDecoder(routed).decode(b'{"type": "AuthorRenamed", "author": {"name": "x"}}')
    assert info.value.event_type == "AuthorRenamed"
    assert info.value.reason == "AuthorRenamed: missing field 'author.id' (of a tag)"


def test_unrouted_fields_are_not_checked() -> None:
    """Deleting a key is always safe: a producer's extra or missing metadata must not
    stop it (only the fields that build keys are strict)."""
    decoder = EventDecoder(config())
    assert decoder.decode(b'{"type":"BookPriceChanged","book_id":"isbn-1","extra":[1]}').targets


POISON: list[tuple[bytes | None, str]] = [
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
]


@pytest.mark.parametrize(("data", "reason"), POISON)
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
    decoder = EventDecoder(config())
    keys: dict[str, int] = {}
    for book in (1, 2, 1):
        decoder.collect(b'{"type":"BookPriceChanged","book_id":%d}' % book, keys, [])
    assert list(keys.items()) == [("env:book:1", 8), ("env:book:2", 8)]


ROUTES = [
    {"type": "BookPriceChanged", "invalidate": [{"namespace": "book", "key": {"id": "book_id"}}]},
    {
        "type": "BookMoved",  # not a plain route: nested field, two-field template
        "invalidate": [
            {"namespace": "book", "key": {"id": "book.id"}},
            {"namespace": "shelf", "key": {"store": "store", "id": "to_shelf"}},
        ],
    },
    {
        "type": "AuthorRenamed",  # plain, two keys
        "invalidate": [
            {"namespace": "author", "key": {"id": "author_id"}},
            {"namespace": "book", "key": {"id": "book_id"}},
        ],
    },
    {"type": "Tagged", "invalidate": [{"tag": "author:{author_id}"}]},
]
MESSAGES = [
    b'{"type":"BookPriceChanged","book_id":42,"old_price":"1","new_price":"2"}',
    b'{"type":"BookPriceChanged","book_id":"isbn-1"}',
    b'{"type":"BookPriceChanged","book_id":"a:b"}',
    b'{"type":"BookMoved","book":{"id":7},"store":"berlin","to_shelf":3}',
    b'{"type":"BookMoved","book":{"id":7},"store":"berlin"}',
    b'{"type":"AuthorRenamed","author_id":1,"book_id":2}',
    b'{"type":"AuthorRenamed","author_id":1,"book_id":true}',
    b'{"type":"Tagged","author_id":5}',
    b'{"type":"CacheInvalidate","namespace":"author","keys":[{"id":1},{"id":"x"}]}',
    b'{"type":"BookPriceChanged","book_id":' + b"9" * 5000 + b"}",
    b'{"type":"BookPriceChanged","book_id":' + b"9" * 30 + b"}",
    b'{"type":"BookPriceChanged","book_id":"' + b"x" * 600 + b'"}',
    b'{"type":["BookPriceChanged"],"book_id":1}',
    b"[" * 2000,
    *(data for data, _ in POISON if data is not None),
]


def _decode_into(decoder: EventDecoder, data: bytes) -> tuple[object, ...]:
    try:
        decoded = decoder.decode(data)
    except PoisonEvent as exc:
        return ("poison", exc.reason, exc.event_type)
    keys: dict[str, int] = {}
    for target in decoded.targets:
        keys.setdefault(target.key, target.replicas)
    return (decoded.event_type, keys, decoded.tags)


def _collect_into(decoder: EventDecoder, data: bytes) -> tuple[object, ...]:
    keys: dict[str, int] = {"env:earlier": 1}  # a batch's earlier key
    tags: list[str] = ["earlier"]
    try:
        event_type = decoder.collect(data, keys, tags)
    except PoisonEvent as exc:
        assert keys == {"env:earlier": 1} and tags == ["earlier"], "poison added something"
        return ("poison", exc.reason, exc.event_type)
    del keys["env:earlier"]
    return (event_type, keys, tags[1:])


@pytest.mark.parametrize("data", MESSAGES)
def test_the_daemons_collect_agrees_with_decode(data: bytes) -> None:
    """``collect`` (the daemon's path, with its shortcut for plain routes) turns every
    message into the same keys, tags and type as ``decode``, or the same poison."""
    decoder = EventDecoder(config(ROUTES))
    assert _collect_into(decoder, data) == _decode_into(decoder, data)


@given(
    st.one_of(
        st.integers(), st.text(max_size=40), st.booleans(), st.none(), st.floats(),
        st.lists(st.integers(), max_size=2),
    ),
    st.sampled_from(["BookPriceChanged", "AuthorRenamed", "Tagged", "BookMoved", "Other"]),
)
def test_collect_agrees_with_decode_for_any_key_value(value: Any, event_type: str) -> None:
    decoder = EventDecoder(config(ROUTES))
    data = msgspec.json.encode(
        {"type": event_type, "book_id": value, "author_id": value, "book": {"id": value}}
    )
    assert _collect_into(decoder, data) == _decode_into(decoder, data)


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


def test_a_tag_field_whose_value_names_another_placeholder_is_not_filled_twice() -> None:
    """``author:{author}:ed:{ed}`` with author = "{ed}": filled field by field, the
    "{ed}" inside the value was filled too, and the event invalidated author:7:ed:7,
    another tag than its own (which is no valid tag: the event is poison)."""
    from tests.helpers import make_config

    routed = make_config(
        "redis://127.0.0.1:1", "p:",
        events=[{"type": "Tagged", "invalidate": [{"tag": "author:{author}:ed:{ed}"}]}],
    )
    decoder = EventDecoder(routed)
    assert "tag" in poison_reason(decoder, b'{"type":"Tagged","author":"{ed}","ed":"7"}')
    tags: list[str] = []
    decoder.collect(b'{"type":"Tagged","author":"ann","ed":"7"}', {}, tags)
    assert tags == ["author:ann:ed:7"]


@pytest.mark.parametrize(
    "value",
    [
        "Alice Smith, 12 Harbour Road, Flat 3, Portsmouth PO1 2AB, alice.smith@example.com",
        "alice.smith." * 30 + "example.com",  # safe characters, but a tag over 256
    ],
)
def test_with_redact_keys_a_rejected_long_tag_is_named_by_its_hash_only(value: str) -> None:
    """The reason of a tag validate_tag refused was validate_tag's message with the
    tag's forms replaced by its hash; it quotes the first 80 characters, which no
    replacement found: a tag over 80 characters (the route's text and the producer's
    value) went out in clear, in the DLQ header and the log line."""
    from layered_cache._logs import redact_key
    from tests.helpers import make_config

    config = make_config(
        "redis://127.0.0.1:1/0",
        "p:",
        {"author": {"key": "author:{id}", "tags": True}},
        logging={"redact_keys": True},
        events=[{"type": "AuthorRenamed", "invalidate": [{"tag": "author:{name}"}]}],
    )
    decoder = EventDecoder(config, env={"LAYERED_CACHE_LOG_REDACT_SALT": "pepper"})
    event = msgspec.json.encode({"type": "AuthorRenamed", "name": value})
    with pytest.raises(PoisonEvent) as collected:
        decoder.collect(event, {}, [])  # the daemon's way
    for reason in (poison_reason(decoder, event), collected.value.reason):
        assert value[:12] not in reason, reason
        assert redact_key(f"author:{value}", b"pepper") in reason
