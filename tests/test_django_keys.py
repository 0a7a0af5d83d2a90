"""Django keys map to key field values injectively: readable where the key rules allow
it, hashed (and marked) otherwise, and every value builds a valid Redis name."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from layered_cache._django_keys import MAX_READABLE, django_key, field_value
from layered_cache._keys import KeyTemplate

TEMPLATE = KeyTemplate("django", "django:{key}", "shop:")
READABLE_ALPHABET = "abcXYZ019_.:@+-"
# Any text (surrogates and control characters included), readable-looking text (colons
# dense, near the length limit), and the characters that force hashing.
any_text = st.text(st.characters(codec=None, categories=None))
readable = st.text(st.sampled_from(READABLE_ALPHABET), min_size=0, max_size=MAX_READABLE + 2)
near_misses = st.builds(
    lambda a, c, b: a + c + b, readable, st.sampled_from("/= %#{}\n清"), readable
)
django_keys = st.one_of(any_text, readable, near_misses)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (":1:answer", "/1/answer"),
        (
            "shop:2:views.decorators.cache.cache_page..GET.abc",
            "shop/2/views.decorators.cache.cache_page..GET.abc",
        ),
        ("a" * MAX_READABLE, "a" * MAX_READABLE),
    ],
)
def test_keys_of_the_safe_alphabet_stay_readable(key: str, value: str) -> None:
    assert field_value(key) == value
    assert TEMPLATE.build({"key": field_value(key)}) == f"shop:django:{value}"


@pytest.mark.parametrize(
    "key", ["", "a/b", "a=b", "key with spaces", "清", "a" * (MAX_READABLE + 1)]
)
def test_other_keys_are_hashed_and_marked(key: str) -> None:
    value = field_value(key)
    assert value.startswith("=") and len(value) == 65
    assert django_key(value) is None


@given(django_keys, django_keys)
@example(":a", "/a")  # ':' is written '/', so a key holding '/' must not be readable
@example("=" + "0" * 64, "")  # a key that looks like a hashed value is itself hashed
@example("a" * MAX_READABLE, "a" * (MAX_READABLE + 1))
def test_distinct_django_keys_never_share_a_redis_name(a: str, b: str) -> None:
    if a != b:
        assert field_value(a) != field_value(b)
        assert TEMPLATE.build({"key": field_value(a)}) != TEMPLATE.build({"key": field_value(b)})


@given(django_keys)
def test_every_key_builds_a_valid_name_that_parses_back(key: str) -> None:
    value = field_value(key)
    name = TEMPLATE.build({"key": value})  # the key rules accept every value
    assert TEMPLATE.parse(name) == {"key": value}
    # the two forms are disjoint: '=' marks hashed values and never occurs in readable ones
    readable_form = django_key(value)
    if readable_form is None:
        assert value.startswith("=")
    else:
        assert "=" not in value and readable_form == key  # readable: undone exactly
