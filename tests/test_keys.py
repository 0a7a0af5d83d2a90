"""Key names: templates, validation errors that name the field, replica and lease names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layered_cache.keys import MAX_KEY_LENGTH, KeyTemplate, lease_name, replica_names


def test_template_fills_fields_with_prefix() -> None:
    assert KeyTemplate("book", "book:{id}", "shop:").build({"id": 42}) == "shop:book:42"
    template = KeyTemplate("price", "price:{id}:{currency}")
    assert template.build({"id": 1, "currency": "EUR"}) == "price:1:EUR"


def test_replica_and_lease_names() -> None:
    assert replica_names("book:42", 3) == ["book:42#0", "book:42#1", "book:42#2"]
    assert lease_name("book:42") == "{book:42}:lease"


def test_missing_field_names_namespace_and_field() -> None:
    with pytest.raises(KeyError, match="namespace 'book': missing key field 'id'"):
        KeyTemplate("book", "book:{id}").build({"isbn": 1})


@pytest.mark.parametrize(
    "value",
    [
        "a b",
        "a{b}",
        "x#1",
        "tab\t",
        "new\nline",
        "",
        "\x00",
        "é",
        "x" * (MAX_KEY_LENGTH + 1),
        "k" * 10_240,
    ],
)
def test_unsafe_values_are_rejected_naming_the_field(value: str) -> None:
    with pytest.raises(ValueError, match="namespace 'book': field 'id'"):
        KeyTemplate("book", "book:{id}").build({"id": value})


def test_wrong_types_and_overlong_keys_are_rejected() -> None:
    with pytest.raises(ValueError, match="must be an int or str, got float"):
        KeyTemplate("book", "book:{id}").build({"id": 1.5})
    with pytest.raises(ValueError, match="must be an int or str, got bool"):
        KeyTemplate("book", "book:{id}").build({"id": True})
    with pytest.raises(ValueError, match="over the limit"):
        KeyTemplate("book", "book:{id}").build({"id": 10 ** (MAX_KEY_LENGTH + 5)})


def test_bad_templates_and_prefixes() -> None:
    with pytest.raises(ValueError):
        KeyTemplate("book", "book {id}")
    with pytest.raises(ValueError):
        KeyTemplate("book", "book:{id}", prefix="{tenant}")
    with pytest.raises(ValueError):
        KeyTemplate("book", "book:{id}:{id}")


@given(st.one_of(st.text(max_size=600), st.integers()))
def test_any_value_builds_a_safe_key_or_raises(value: object) -> None:
    try:
        key = KeyTemplate("book", "book:{id}").build({"id": value})
    except ValueError:
        return
    assert len(key) <= MAX_KEY_LENGTH
    assert not any(ch in key for ch in "{}# \t\r\n")
