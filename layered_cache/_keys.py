"""Key names: namespace templates, validation, and every name the library owns.

Every Redis name the library touches is built here, so the naming contract lives in one
place (docs/keys.md):

- base key        ``{prefix}book:42``
- replica shard   ``{prefix}book:42#3``    (no hash tag: replicas spread over slots)
- lease           ``{{prefix}book:42}:lease`` (hash tag = the base key: same slot, so one
                  Lua script may check the lease and write the base key atomically)
- lock            ``{{prefix}django:/1/hits}:lock`` (Django's add/incr/decr/touch of
                  the key, ``_django_locked``: unlike the lease, no write revokes it)
- fill channel    ``{{prefix}book:42}:filled`` (pub/sub: a fill wakes the lease waiters;
                  ``...:filled:db3`` outside database 0)
- backplane       ``{prefix}layered_cache:invalidations`` (``backplane.stream``)
- hot-key report  ``{prefix}layered_cache:hotkeys:{instance}`` (one hash per instance)
- replica record  ``{{prefix}layered_cache}:replicas`` (the fleet's ``hot.replicas``)
- tag version     ``{prefix}layered_cache:tag:{tag}`` (the tag's current token)
- loading set     ``{prefix}layered_cache:loading`` (leases of tagged loads in flight)

One name per value: ``build`` is injective over (prefix, namespace, fields). Field values
never contain ``:`` in a name (it is written ``%3A``; a raw ``%`` is refused, so the
encoding is reversible), and between two placeholders a template has literal text with a
``:``, so every field's extent in a name is unambiguous. Keys never contain ``{``, ``}``
or ``#``, so no key equals a lease, channel or replica name, and no template can start
inside the reserved ``layered_cache:`` segment. A bad key is a ``ValueError``/
``KeyError``/``TypeError`` naming the namespace and field, never a silently malformed name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from layered_cache._keyparse import split_name
from layered_cache._templates import (
    RESERVED_SEGMENT,
    SAFE_DESCRIPTION,
    SAFE_LITERAL,
    check_template,
    parse_template,
)

__all__ = [
    "MAX_KEY_LENGTH", "RESERVED_SEGMENT", "KeyTemplate", "backplane_stream_name",
    "fill_channel", "hot_report_name", "is_tag", "lease_name", "loading_set_name", "lock_name",
    "replica_name", "replica_names", "replica_record_name", "tag_problem", "tag_version_name",
    "validate_prefix", "validate_tag",
]

MAX_KEY_LENGTH = 512
MAX_TAG_LENGTH = 256
MAX_PREFIX_LENGTH = 64
TAG_PATTERN = r"^[A-Za-z0-9_.:@/=+\-]+$"  # key values and tags (``is_tag``)
_SAFE_VALUE = re.compile(TAG_PATTERN)
_ABSENT = object()
# Validated field values remembered per template (see KeyTemplate.build); when full the
# memo is emptied and refills with whatever is hot now: bounded, and O(1) per call.
_MEMO_SIZE = 2048


def validate_prefix(prefix: str) -> str:
    """The global prefix is part of every name: safe characters, and it ends with ``:``
    so that a prefix and the template after it never run into one another."""
    if not prefix:
        return prefix
    if not SAFE_LITERAL.fullmatch(prefix) or len(prefix) > MAX_PREFIX_LENGTH:
        raise ValueError(
            f"redis.prefix {prefix!r} may only contain {SAFE_DESCRIPTION} "
            f"(at most {MAX_PREFIX_LENGTH})"
        )
    if not prefix.endswith(":") or prefix.startswith(":") or "::" in prefix:
        raise ValueError(
            f"redis.prefix {prefix!r} must be segments each ending with ':', "
            "e.g. 'shop:' or 'prod:shop:'"
        )
    if RESERVED_SEGMENT[:-1] in prefix.split(":"):
        # Not even nested (``shop:layered_cache:``): its keys would be the reserved names
        # (stream, fleet hashes) of the deployment whose prefix is ``shop:``.
        raise ValueError(
            f"redis.prefix {prefix!r} may not contain the reserved segment {RESERVED_SEGMENT!r}"
        )
    return prefix


class KeyTemplate:
    """A compiled ``book:{id}`` template: fills fields into a validated key name.

    Compiled once per namespace; ``build`` is on every request's path, so it does a
    dict lookup per field, a type check, and a regex only for a string value it has not
    validated recently (``_memo``).
    """

    __slots__ = ("_literals", "_memo", "_single", "fields", "namespace", "prefix", "template")

    def __init__(self, namespace: str, template: str, prefix: str = "") -> None:
        self.namespace = namespace
        self.template = template
        self.prefix = validate_prefix(prefix)
        literals, fields = parse_template(namespace, template)
        check_template(namespace, template, literals, fields)
        literals[0] = self.prefix + literals[0]
        self._literals = tuple(literals)
        self.fields: tuple[str, ...] = tuple(fields)
        # Most templates have one field (``book:{id}``): a dedicated path, no list/join.
        self._single = fields[0] if len(fields) == 1 else None
        # Hot keys repeat, and a string value costs a regex to validate. One field: a
        # valid int/str value -> its full key; several: a valid str value -> its text.
        # Only values that passed validation are stored, so a bad value still raises;
        # ints and strs never compare equal, so ``42`` and ``"42"`` can't be confused
        # (each maps to the same key anyway), and the type is checked before the lookup
        # (``True == 1``, ``42.0 == 42``: those must still be refused).
        self._memo: dict[object, str] = {}

    def single_memo(self) -> tuple[str, dict[object, str]] | None:
        """A one-field template's field and the memo ``build`` reads first (a valid int
        or str value -> its full key), for a caller that inlines that lookup."""
        return None if self._single is None else (self._single, self._memo)

    def build(self, fields: Mapping[str, object]) -> str:
        """The full Redis name (prefix included) for these key fields."""
        single = self._single
        if single is not None:
            try:
                value = fields[single]
            except (LookupError, TypeError):  # absent, or not a mapping: the full path
                return self._build_fields(fields)  # raises, saying which
            kind = type(value)
            # One field and no other: a field the template doesn't name would
            # otherwise be dropped, and callers differing only in it share one entry.
            if (kind is int or kind is str) and len(fields) == 1:
                # Subscripts, not ``.get``: this is the L1-hit path, and a method call
                # costs more than the lookup itself (bench/l1_hit.py).
                try:
                    return self._memo[value]
                except KeyError:
                    return self._build_single(single, value)
        return self._build_fields(fields)

    def build_value(self, value: int | str) -> str:
        """``build({field: value})`` of a one-field template, raising as it does.

        For the daemon, where nearly every key is new (an event per changed row): an
        int is formatted directly, past the memo - its text needs no regex, and
        remembering it would only churn the memo; a str goes through ``build``."""
        single = self._single
        if single is None:
            raise TypeError(f"namespace {self.namespace!r}: template {self.template!r} has "
                            "several fields")
        if type(value) is not int:
            return self.build({single: value})
        literals = self._literals
        try:
            text = str(value)
        except ValueError:
            text = self._int_text(single, value)  # raises, naming namespace and field
        key = literals[0] + text + literals[1]
        if len(key) > MAX_KEY_LENGTH:
            raise self._too_long(key)
        return key

    def _build_single(self, single: str, value: object) -> str:
        """A one-field key not in the memo: validated, then remembered."""
        literals = self._literals
        key = literals[0] + self._text(single, value) + literals[1]
        if len(key) > MAX_KEY_LENGTH:
            raise self._too_long(key)
        memo = self._memo
        if len(memo) >= _MEMO_SIZE:
            memo.clear()
        memo[value] = key
        return key

    def _build_fields(self, fields: Mapping[str, object]) -> str:
        if not isinstance(fields, Mapping):
            raise self._not_a_mapping(fields)
        literals = self._literals
        parts = [literals[0]]
        for index, name in enumerate(self.fields):
            try:
                value = fields[name]
            except KeyError:
                raise KeyError(
                    f"namespace {self.namespace!r}: missing key field {name!r} "
                    f"(template {self.template!r})"
                ) from None
            parts.append(self._text(name, value))
            parts.append(literals[index + 1])
        if len(fields) != len(self.fields):
            raise self._unnamed(fields)
        key = "".join(parts)
        if len(key) > MAX_KEY_LENGTH:
            raise self._too_long(key)
        return key

    def _too_long(self, key: str) -> ValueError:
        return ValueError(
            f"namespace {self.namespace!r}: key is {len(key)} characters, "
            f"over the limit of {MAX_KEY_LENGTH}"
        )

    def owns(self, name: str) -> bool:
        """Whether ``name`` starts as this template's names do: of one config's
        namespaces, no two start alike (docs/keys.md), and no parse is needed."""
        return name.startswith(self._literals[0])

    def parse(self, name: str) -> dict[str, str] | None:
        """The field values (as text) ``name`` was built from, or None if no fields build
        it. The inverse of ``build``: that it exists is why names are injective.

        Fields are kept only if ``build`` makes ``name`` from them again: a name under
        the template's literals that ``build`` would refuse (over the length limits) is
        None, as callers act on the fields (``clear()`` invalidates by them, a static
        hot key is matched by them) and must skip such a foreign name, not raise on it."""
        if len(name) > MAX_KEY_LENGTH:
            return None
        values = split_name(self._literals, self.fields, name)
        if values is None:
            return None
        try:
            return values if self._build_fields(values) == name else None
        except (KeyError, TypeError, ValueError):
            return None

    def _unnamed(self, fields: Mapping[str, object]) -> KeyError:
        """A field the template doesn't name: refused, not dropped. Dropped, it would
        let ``{"id": 1, "lang": "fr"}`` and ``{"id": 1, "lang": "en"}`` share one entry
        (the CLI, ``warm`` and ``cached`` refuse such fields for the same reason)."""
        unnamed = sorted(repr(name) for name in fields if name not in self.fields)
        return KeyError(
            f"namespace {self.namespace!r}: unknown key field {', '.join(unnamed)} "
            f"(template {self.template!r} names {', '.join(map(repr, self.fields)) or 'none'})"
        )

    def _not_a_mapping(self, fields: object) -> TypeError:
        return TypeError(
            f"namespace {self.namespace!r}: key fields must be a mapping such as "
            f"{{{', '.join(repr(f) + ': ...' for f in self.fields)}}}, "
            f"got {type(fields).__name__}"
        )

    def _int_text(self, name: str, value: int) -> str:
        """``str(value)``; an int past Python's digit limit names the namespace and field."""
        try:
            return str(value)
        except ValueError:
            raise ValueError(
                f"namespace {self.namespace!r}: field {name!r} is an int too long for a key "
                f"(limit {MAX_KEY_LENGTH} characters)"
            ) from None

    def _remember(self, value: str, text: str) -> str:
        """Several fields: remember a validated string value's text (see ``_memo``)."""
        if self._single is None:
            memo = self._memo
            if len(memo) >= _MEMO_SIZE:
                memo.clear()
            memo[value] = text
        return text

    def _text(self, name: str, value: object) -> str:
        """One field as it appears in the name: ``:`` written ``%3A`` (see module doc)."""
        kind = type(value)
        if kind is int:
            return self._int_text(name, value)  # type: ignore[arg-type]
        if kind is str:
            text: str = value  # type: ignore[assignment]
            known = self._memo.get(text) if self._single is None else None
            if known is not None:
                return known
            if len(text) <= MAX_KEY_LENGTH and _SAFE_VALUE.fullmatch(text):
                return self._remember(text, text.replace(":", "%3A") if ":" in text else text)
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise ValueError(
                f"namespace {self.namespace!r}: field {name!r} = {shown!r} is not a safe "
                f"key value (1..{MAX_KEY_LENGTH} of {SAFE_DESCRIPTION})"
            )
        raise ValueError(
            f"namespace {self.namespace!r}: field {name!r} must be an int or str, "
            f"got {kind.__name__}"
        )


def replica_name(key: str, index: int) -> str:
    """Replica shard ``key#index``; no braces, so each replica hashes to its own slot."""
    return f"{key}#{index}"


def replica_names(key: str, replicas: int) -> list[str]:
    return [f"{key}#{index}" for index in range(replicas)]


def lease_name(key: str) -> str:
    """``{key}:lease``: the hash tag pins the lease to the base key's slot."""
    return "{" + key + "}:lease"


def lock_name(key: str) -> str:
    """``{key}:lock``: the lock Django's read-modify-write calls (``add``, ``incr``,
    ``touch``) take besides the lease. A write revokes the lease (a fill must not land
    after it), which let a ``set`` release an ``incr`` in flight to the next one; no
    write or invalidation touches this name. Same slot as the key (the hash tag)."""
    return "{" + key + "}:lock"


def fill_channel(key: str, db: int = 0) -> str:
    """``{key}:filled``: the pub/sub channel the fill script announces ``key``'s new value
    on. Braces never occur in a key, so no key is named like a channel.

    Outside database 0 the number follows (``{key}:filled:db1``): pub/sub channels are
    server-wide while keys are per database, and a waiter takes the message as its value,
    so a deployment in database 1 would otherwise hand its fills to the same key's
    waiters in database 0. (A cluster has database 0 only.)"""
    channel = "{" + key + "}:filled"
    return channel if not db else f"{channel}:db{db}"


def backplane_stream_name(prefix: str, stream: str) -> str:
    """The backplane stream: ``backplane.stream`` after the prefix. The stream must be in
    the reserved segment (the config refuses anything else), where no key can be."""
    if not stream.startswith(RESERVED_SEGMENT):
        raise ValueError(f"backplane stream {stream!r} must start with {RESERVED_SEGMENT!r}")
    return prefix + stream


def hot_report_name(prefix: str, instance_id: str) -> str:
    """The hash one cache instance reports its hot keys in (``hotreport.py``), in the
    reserved segment; ``instance_id="*"`` gives the SCAN pattern of the whole fleet's."""
    return f"{prefix}{RESERVED_SEGMENT}hotkeys:{instance_id}"


def replica_record_name(prefix: str) -> str:
    """The hash of recorded replica counts (``invalidation.check_replica_counts``).
    Braces can't occur in a key, and it ends in none of ``:lease``, ``:lock``,
    ``:filled``: no key, lease, lock or channel is named so."""
    return "{" + prefix + RESERVED_SEGMENT[:-1] + "}:replicas"




def is_tag(tag: str) -> bool:
    """Whether ``validate_tag`` accepts ``tag``, without the error (tags read back)."""
    return len(tag) <= MAX_TAG_LENGTH and _SAFE_VALUE.fullmatch(tag) is not None


def tag_problem(tag: str) -> str | None:
    """What makes ``tag`` no tag, in words that quote none of it (the daemon's reasons
    under ``logging.redact_keys`` name the tag by its hash), or None for a tag."""
    if not _SAFE_VALUE.fullmatch(tag):
        return f"only {SAFE_DESCRIPTION} are allowed"
    if len(tag) > MAX_TAG_LENGTH:
        return f"longer than {MAX_TAG_LENGTH} characters"
    return None


def validate_tag(tag: object) -> str:
    """A tag (``book:42``) obeys the key character rules: the same safe characters, a
    length limit, and a clear error naming what is wrong."""
    if not isinstance(tag, str):
        raise TypeError(f"a tag must be a string, not {type(tag).__name__}: {tag!r}")
    if (problem := tag_problem(tag)) is not None:
        shown = f"{tag[:80]!r}..." if len(tag) > 80 else repr(tag)
        raise ValueError(f"tag {shown}: {problem}")
    return tag


def tag_version_name(prefix: str, tag: str) -> str:
    """The tag's current version token (``_tags.py``), in the reserved segment: no key
    can be named so, and the tag text can't reach out of it (tags are validated)."""
    return f"{prefix}{RESERVED_SEGMENT}tag:{tag}"


def loading_set_name(prefix: str) -> str:
    """The set of leases held by loads of tagged entries (``_tags.py``):
    ``invalidate_tag`` revokes them, so a load that began before it never lands."""
    return f"{prefix}{RESERVED_SEGMENT}loading"
