"""Key names: templates, validation errors that name the field, replica and lease names,
and the one-name-per-value property (docs/keys.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from layered_cache import ConfigError, parse_config
from layered_cache._config import BackplaneConfig
from layered_cache._keys import (
    MAX_KEY_LENGTH,
    RESERVED_SEGMENT,
    KeyTemplate,
    backplane_stream_name,
    fill_channel,
    hot_report_name,
    lease_name,
    lock_name,
    replica_name,
    replica_names,
    replica_record_name,
)
from tests.helpers import make_config, open_cache


def test_template_fills_fields_with_prefix() -> None:
    assert KeyTemplate("book", "book:{id}", "shop:").build({"id": 42}) == "shop:book:42"
    template = KeyTemplate("price", "price:{id}:{currency}")
    assert template.build({"id": 1, "currency": "EUR"}) == "price:1:EUR"


def test_common_keys_keep_their_names() -> None:
    """Ints, slugs and ISBN-like strings build the same names as before the encoding."""
    assert KeyTemplate("book", "book:{id}").build({"id": -7}) == "book:-7"
    assert KeyTemplate("cat", "category:{slug}").build({"slug": "sci-fi_2"}) == "category:sci-fi_2"
    isbn = KeyTemplate("isbn", "isbn:{isbn}", "prod:shop:")
    assert isbn.build({"isbn": "978-3-16-148410-0"}) == "prod:shop:isbn:978-3-16-148410-0"
    assert KeyTemplate("u", "u:{mail}").build({"mail": "a.b+c@x.org/=1"}) == "u:a.b+c@x.org/=1"


def test_parse_is_the_inverse_of_build() -> None:
    acl = KeyTemplate("acl", "acl:{tenant}:x{user}:end", "shop:")
    name = acl.build({"tenant": "acme:bob", "user": "x"})
    assert acl.parse(name) == {"tenant": "acme:bob", "user": "x"}
    assert acl.parse("shop:acl:acme:xy:end") == {"tenant": "acme", "user": "y"}
    for other in ("shop:acl:acme:y:end", "acl:a:xb:end", "shop:acl::x1:end", "shop:acl:a:x1:end:"):
        assert acl.parse(other) is None
    assert KeyTemplate("c", "config").parse("config") == {}


def test_a_name_build_could_not_have_made_parses_to_nothing() -> None:
    """``clear()`` and ``hot.keys`` act on what parse finds: a name over build's length
    limit (in its value, or whole with the prefix) is no key of the template."""
    keys = KeyTemplate("django", "django:{key}", "shop:")
    assert keys.parse("shop:django:" + "a" * 600) is None
    longest = keys.build({"key": "a" * (512 - len("shop:django:"))})
    assert keys.parse(longest) == {"key": "a" * 500}
    assert keys.parse(longest + "a") is None
    two = KeyTemplate("p", "p:{a}:{b}")
    assert two.parse("p:x:" + "b" * 600) is None and two.parse("p:x:y") == {"a": "x", "b": "y"}


def test_replica_and_lease_names() -> None:
    assert replica_names("book:42", 3) == ["book:42#0", "book:42#1", "book:42#2"]
    assert lease_name("book:42") == "{book:42}:lease"
    assert lock_name("django:/1/hits") == "{django:/1/hits}:lock"  # Django's add/incr/touch


def test_missing_field_names_namespace_and_field() -> None:
    with pytest.raises(KeyError, match="namespace 'book': missing key field 'id'"):
        KeyTemplate("book", "book:{id}").build({"isbn": 1})


@pytest.mark.parametrize("template", ["book:{id}", "price:{id}:{currency}", "settings"])
def test_a_field_the_template_does_not_name_is_refused_naming_it(template: str) -> None:
    keys = KeyTemplate("book", template, "shop:")
    named = {name: 1 for name in keys.fields}
    keys.build(named)  # remembered (a one-field template's memo): the extra still counts
    with pytest.raises(KeyError, match="namespace 'book': unknown key field 'lang'"):
        keys.build({**named, "lang": "fr"})


async def test_callers_differing_in_a_field_the_template_does_not_name_never_share_an_entry(
    redis_url: str, prefix: str
) -> None:
    """Dropped, the field let the 'fr' caller be served the 'en' entry."""
    config = make_config(redis_url, prefix, {"page": {"key": "page:{id}"}})
    async with open_cache(config) as cache:

        async def english() -> str:
            return "Hello"

        assert await cache.get_or_load("page", {"id": 1}, english) == "Hello"
        for call in (
            cache.get_or_load("page", {"id": 1, "lang": "fr"}, english),
            cache.get("page", {"id": 1, "lang": "fr"}),
            cache.get_many("page", [{"id": 1, "lang": "fr"}]),
            cache.set("page", {"id": 1, "lang": "fr"}, "Bonjour"),
        ):
            with pytest.raises(KeyError, match="unknown key field 'lang'"):
                await call
        assert await cache.get("page", {"id": 1}) == "Hello"


@pytest.mark.parametrize("fields", [[("id", 1)], "id=1", 42, None])
def test_fields_that_are_not_a_mapping_get_a_type_error_naming_the_namespace(
    fields: object,
) -> None:
    for template in ("book:{id}", "price:{id}:{currency}"):
        with pytest.raises(TypeError, match="namespace 'book': key fields must be a mapping"):
            KeyTemplate("book", template).build(fields)  # type: ignore[arg-type]


def test_an_int_too_long_to_convert_names_namespace_and_field() -> None:
    huge = 10**5000
    for template in ("book:{id}", "price:{id}:{currency}"):
        with pytest.raises(ValueError, match="namespace 'book': field 'id' is an int too long"):
            KeyTemplate("book", template).build({"id": huge, "currency": "EUR"})


@pytest.mark.parametrize(
    "value",
    [
        "a b",
        "a{b}",
        "x#1",
        "50%",
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


def test_a_remembered_value_never_lets_an_equal_value_of_another_type_through() -> None:
    """Validated values are remembered (the regex is skipped for hot keys); ``True == 1``
    and ``42.0 == 42``, yet they are still refused once 1 and 42 were built."""
    template = KeyTemplate("book", "book:{id}")
    assert template.build({"id": 1}) == template.build({"id": 1}) == "book:1"
    assert template.build({"id": 42}) == "book:42"
    assert template.build({"id": "42"}) == "book:42"
    with pytest.raises(ValueError, match="got bool"):
        template.build({"id": True})
    with pytest.raises(ValueError, match="got float"):
        template.build({"id": 42.0})
    pair = KeyTemplate("price", "price:{id}:{currency}")
    assert pair.build({"id": "a:b", "currency": "EUR"}) == "price:a%3Ab:EUR"
    assert pair.build({"id": "a:b", "currency": "EUR"}) == "price:a%3Ab:EUR"
    with pytest.raises(ValueError, match="got bool"):
        pair.build({"id": True, "currency": "EUR"})


def test_bad_values_are_refused_however_many_good_ones_came_before() -> None:
    """The memo of validated values is bounded (emptied when full) and holds only
    values that passed: a bad value raises on its first and every later call."""
    for template in (KeyTemplate("isbn", "isbn:{isbn}"), KeyTemplate("p", "p:{a}:{b}")):
        for i in range(5_000):
            template.build({name: f"978-0-{i}" for name in template.fields})
        for _ in range(2):
            with pytest.raises(ValueError, match="not a safe key value"):
                template.build({name: "978 0" for name in template.fields})
        assert len(template._memo) <= 2048


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("book:{id", "unclosed placeholder"),
        ("book:{id:{x}", "unclosed placeholder"),
        ("book:{}", "empty placeholder"),
        ("book:id}", "closes no placeholder"),
        ("book:{1d}", "not a field name"),
        ("book {id}", "may only contain"),
        ("book:{id}:{id}", "repeats a field"),
        ("book:{a}{b}", "separated by text containing ':'"),
        ("book:{a}-{b}", "separated by text containing ':'"),
        ("{id}", "must start with literal text"),
        ("layered_cache:{name}", "reserved"),
        ("layered_{x}:invalidations", "reserved"),
        ("", "empty key template"),
    ],
)
def test_bad_templates_say_what_is_wrong(template: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        KeyTemplate("book", template)


@pytest.mark.parametrize(
    "prefix", ["{tenant}", "shop", "shop:x", ":shop:", "a::", "layered_cache:", "a:layered_cache:"]
)
def test_bad_prefixes_are_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match=r"redis\.prefix"):
        KeyTemplate("book", "book:{id}", prefix=prefix)


# -- the three collisions of issue 13 -------------------------------------------------


def test_colons_in_values_cannot_move_between_fields() -> None:
    """Cross-tenant read: ("acme:bob", "x") and ("acme", "bob:x") were one key."""
    acl = KeyTemplate("acl", "acl:{tenant}:{user}")
    one = acl.build({"tenant": "acme:bob", "user": "x"})
    two = acl.build({"tenant": "acme", "user": "bob:x"})
    assert one != two
    assert (one, two) == ("acl:acme%3Abob:x", "acl:acme:bob%3Ax")


def test_a_value_cannot_reach_into_a_longer_prefix() -> None:
    """Cross-prefix read: prefix 'app:' + id 'x:5' was a key of prefix 'app:user:'."""
    outer = KeyTemplate("user", "user:{id}", "app:").build({"id": "x:5"})
    inner = KeyTemplate("x", "x:{id}", "app:user:").build({"id": 5})
    assert outer == "app:user:x%3A5"
    assert outer != inner == "app:user:x:5"


def test_no_template_reaches_the_backplane_stream() -> None:
    """Reserved name: namespace 'layered_cache:{name}' with 'invalidations' was the stream."""
    with pytest.raises(ConfigError, match=r"namespaces\.evil\.key: .*reserved"):
        parse_config({"namespaces": {"evil": {"key": "layered_cache:{name}"}}}, env={})


# -- the property ---------------------------------------------------------------------

_CHARS = "abcz019_.@/=+-"
_segment = st.text(alphabet=_CHARS, min_size=1, max_size=4)
_prefixes = st.one_of(
    st.just(""), st.lists(_segment, min_size=1, max_size=3).map(lambda s: ":".join(s) + ":")
)
_values = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.text(alphabet=_CHARS + ":", min_size=1, max_size=8),
)


@st.composite
def _templates(draw: st.DrawFn) -> str:
    count = draw(st.integers(min_value=0, max_value=3))
    text = draw(st.text(alphabet=_CHARS + ":", min_size=1, max_size=5))
    for index in range(count):
        text += "{f" + str(index) + "}"
        if index < count - 1:
            text += draw(_segment.map(lambda s: s[: len(s) // 2] + ":" + s[len(s) // 2 :]))
        else:
            text += draw(st.text(alphabet=_CHARS + ":", max_size=3))
    return text


def _compiled(prefix: str, template: str) -> KeyTemplate:
    try:
        return KeyTemplate("ns", template, prefix)
    except ValueError:
        assume(False)
        raise


def _normal(fields: dict[str, object]) -> dict[str, str]:
    """An int and its decimal string are one key value (``{"id": 42}`` = ``{"id": "42"}``)."""
    return {name: str(value) for name, value in fields.items()}


def _reserved(name: str) -> bool:
    return "{" in name or "}" in name or "#" in name


_STREAM = BackplaneConfig().stream
_INSTANCES = ("i-1", "0123456789ab")  # cache.py's ids are 12 hex digits


def _owned_names(prefix: str, key: str) -> list[str]:
    """Every name the library builds besides keys: for ``key`` (its lease, lock, fill
    channel, replicas and their leases) and for the deployment (stream, reports, replica
    record)."""
    replicas = replica_names(key, 8)
    return [
        lease_name(key),
        lock_name(key),
        fill_channel(key),
        *replicas,
        *(lease_name(replica) for replica in replicas),
        backplane_stream_name(prefix, _STREAM),
        *(hot_report_name(prefix, instance) for instance in _INSTANCES),
        replica_record_name(prefix),
    ]


@settings(max_examples=300, deadline=None)
@given(_prefixes, _templates(), _templates(), st.data())
def test_names_are_injective_and_never_reserved(
    prefix: str, first: str, second: str, data: st.DataObject
) -> None:
    """Within one config: distinct (namespace, fields) -> distinct names, none reserved."""
    one, two = _compiled(prefix, first), _compiled(prefix, second)
    if first != second:
        try:  # two namespaces of one config: the config check must accept them together
            parse_config(
                {
                    "redis": {"prefix": prefix},
                    "namespaces": {"a": {"key": first}, "b": {"key": second}},
                },
                env={},
            )
        except ConfigError:
            assume(False)
    fields_one = {name: data.draw(_values) for name in one.fields}
    fields_two = {name: data.draw(_values) for name in two.fields}
    name_one, name_two = one.build(fields_one), two.build(fields_two)
    same_input = first == second and _normal(fields_one) == _normal(fields_two)
    assert (name_one == name_two) == same_input
    # build has an inverse: the name gives back exactly the fields it was built from
    assert one.parse(name_one) == _normal(fields_one)
    assert two.parse(name_two) == _normal(fields_two)
    owned = _owned_names(prefix, name_one) + _owned_names(prefix, name_two)
    for name in (name_one, name_two):
        assert not _reserved(name)
        assert not name.startswith(prefix + RESERVED_SEGMENT)
        assert name not in owned
    # stronger: no template of the config parses any of those names, so no field values
    # at all (not only the drawn ones) could build one
    assert all(one.parse(name) is None and two.parse(name) is None for name in owned)


@settings(max_examples=200, deadline=None)
@given(_prefixes, _prefixes, _templates(), st.data())
def test_owned_names_are_distinct_from_each_other_and_between_prefixes(
    prefix_a: str, prefix_b: str, template: str, data: st.DataObject
) -> None:
    """Lease, lock, channel, replicas, stream, reports and replica record: no two kinds share a
    name, and two different prefixes share none of them."""
    compiled = _compiled(prefix_a, template)
    key = compiled.build({name: data.draw(_values) for name in compiled.fields})
    names_a = _owned_names(prefix_a, key)
    assert len(set(names_a)) == len(names_a)
    if prefix_a != prefix_b:
        names_b = _owned_names(prefix_b, key)
        deployment_a, deployment_b = names_a[-4:], names_b[-4:]  # stream, reports, record
        assert not set(deployment_a) & set(deployment_b)


def test_owned_names_keep_their_format() -> None:
    """Running fleets and operators' scripts know these names: they must not change."""
    assert fill_channel("shop:book:42") == "{shop:book:42}:filled"
    assert lock_name("shop:django:/1/hits") == "{shop:django:/1/hits}:lock"
    assert replica_name("shop:book:42", 3) == "shop:book:42#3"
    assert backplane_stream_name("shop:", _STREAM) == "shop:layered_cache:invalidations"
    assert hot_report_name("shop:", "ab12") == "shop:layered_cache:hotkeys:ab12"
    assert hot_report_name("shop:", "*") == "shop:layered_cache:hotkeys:*"  # SCAN pattern
    assert replica_record_name("shop:") == "{shop:layered_cache}:replicas"


def test_a_stream_outside_the_reserved_segment_builds_no_name() -> None:
    with pytest.raises(ValueError, match="must start with 'layered_cache:'"):
        backplane_stream_name("shop:", "book:1")


# Two prefixes neither of which starts the other: a shared (possibly empty) path, then
# two different segments. Built, not filtered: "" starts every prefix, so drawing two
# and rejecting the nested pairs discards most draws (hypothesis' filter health check).
_sibling_prefixes = st.tuples(
    st.lists(_segment, max_size=2).map(lambda s: "".join(part + ":" for part in s)),
    st.lists(_segment, min_size=2, max_size=2, unique=True),
).map(lambda t: (t[0] + t[1][0] + ":", t[0] + t[1][1] + ":"))


@settings(max_examples=200, deadline=None)
@given(_sibling_prefixes, _templates(), _templates(), st.data())
def test_deployments_with_sibling_prefixes_never_share_a_name(
    prefixes: tuple[str, str], first: str, second: str, data: st.DataObject
) -> None:
    """Prefixes neither of which starts the other (``shop:``/``blog:``) never collide."""
    prefix_a, prefix_b = prefixes
    assert not prefix_a.startswith(prefix_b) and not prefix_b.startswith(prefix_a)
    one, two = _compiled(prefix_a, first), _compiled(prefix_b, second)
    name_one = one.build({name: data.draw(_values) for name in one.fields})
    name_two = two.build({name: data.draw(_values) for name in two.fields})
    assert name_one != name_two
    assert not name_one.startswith(prefix_b + RESERVED_SEGMENT)


@given(st.one_of(st.text(max_size=600), st.integers()))
def test_any_value_builds_a_safe_key_or_raises(value: object) -> None:
    try:
        key = KeyTemplate("book", "book:{id}").build({"id": value})
    except ValueError:
        return
    assert len(key) <= MAX_KEY_LENGTH
    assert not any(ch in key for ch in "{}# \t\r\n")
    assert ":" not in key[len("book:") :]


def _built(build: Callable[[Any], str], value: object) -> str:
    try:
        return build(value)
    except ValueError as exc:
        return f"ValueError: {exc}"


@given(st.one_of(st.text(max_size=600), st.integers(min_value=-(10**600), max_value=10**600)))
def test_build_value_builds_what_build_does_or_raises_the_same(value: int | str) -> None:
    """The daemon's ``build_value`` (an int past the memo) is ``build`` of one field."""
    template = KeyTemplate("book", "book:{id}", "p:")
    assert _built(template.build_value, value) == _built(
        lambda v: template.build({"id": v}), value
    )


def test_build_value_needs_a_one_field_template() -> None:
    with pytest.raises(TypeError, match="several fields"):
        KeyTemplate("shelf", "shelf:{store}:{id}").build_value(1)


def test_a_backplane_stream_outside_the_reserved_segment_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"backplane.*stream.*reserved"):
        parse_config({"backplane": {"stream": "book:1"}}, env={})


def test_an_invalid_prefix_fails_at_load_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"<memory>: redis\.prefix: .*must be segments"):
        parse_config({"redis": {"prefix": "shop"}}, env={})


def test_a_fill_channel_outside_database_0_names_its_database() -> None:
    """Database 0's channel keeps its name (waiters of the version before still hear
    its fills); another database's is its own (pub/sub is server-wide)."""
    assert fill_channel("shop:book:42") == "{shop:book:42}:filled"
    assert fill_channel("shop:book:42", 0) == "{shop:book:42}:filled"
    assert fill_channel("shop:book:42", 3) == "{shop:book:42}:filled:db3"
