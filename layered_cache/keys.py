"""Key names: namespace templates, validation, replica and lease names.

Every Redis name the library touches is built here, so the naming contract lives in one
place:

- base key        ``{prefix}book:42``
- replica shard   ``{prefix}book:42#3``    (no hash tag: replicas spread over slots)
- lease           ``{{prefix}book:42}:lease`` (hash tag = the base key: same slot, so one
                  Lua script may check the lease and write the base key atomically)

Values inside keys are restricted to a safe character set: no braces (they would change
the Cluster hash tag), no ``#`` (the replica separator), no whitespace or control
characters, and a length limit. A bad key is a ``ValueError``/``KeyError`` naming the
namespace and field, never a silently malformed name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "MAX_KEY_LENGTH",
    "KeyTemplate",
    "lease_name",
    "replica_name",
    "replica_names",
    "validate_prefix",
]

MAX_KEY_LENGTH = 512
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.:@/=+\-]+")
_SAFE_LITERAL = re.compile(r"[A-Za-z0-9_.:@/=+\-]*")
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ABSENT = object()
_SAFE_DESCRIPTION = "letters, digits and _ . : @ / = + -"


def validate_prefix(prefix: str) -> str:
    """The global prefix is part of every name, so it obeys the same character rules."""
    if not _SAFE_LITERAL.fullmatch(prefix) or len(prefix) > 64:
        raise ValueError(
            f"redis.prefix {prefix!r} may only contain {_SAFE_DESCRIPTION} (at most 64)"
        )
    return prefix


class KeyTemplate:
    """A compiled ``book:{id}`` template: fills fields into a validated key name.

    Compiled once per namespace; ``build`` is on every request's path, so it does a
    dict lookup per field, a type check, and a regex only for string values.
    """

    __slots__ = ("_literals", "_single", "fields", "namespace", "prefix", "template")

    def __init__(self, namespace: str, template: str, prefix: str = "") -> None:
        self.namespace = namespace
        self.template = template
        self.prefix = validate_prefix(prefix)
        literals: list[str] = []
        fields: list[str] = []
        position = 0
        for match in _FIELD.finditer(template):
            literals.append(template[position : match.start()])
            fields.append(match.group(1))
            position = match.end()
        literals.append(template[position:])
        for literal in literals:
            if not _SAFE_LITERAL.fullmatch(literal):
                raise ValueError(
                    f"template {template!r} of namespace {namespace!r}: text outside "
                    f"{{field}} placeholders may only contain {_SAFE_DESCRIPTION}"
                )
        if len(set(fields)) != len(fields):
            raise ValueError(f"template {template!r} repeats a field")
        if not template:
            raise ValueError(f"namespace {namespace!r} has an empty key template")
        literals[0] = self.prefix + literals[0]
        self._literals = tuple(literals)
        self.fields: tuple[str, ...] = tuple(fields)
        # Most templates have one field (``book:{id}``): a dedicated path, no list/join.
        self._single = fields[0] if len(fields) == 1 else None

    def build(self, fields: Mapping[str, object]) -> str:
        """The full Redis name (prefix included) for these key fields."""
        literals = self._literals
        single = self._single
        if single is not None:
            value = fields.get(single, _ABSENT)
            if type(value) is int:
                key = literals[0] + str(value) + literals[1]
                if len(key) <= MAX_KEY_LENGTH:
                    return key
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
        key = "".join(parts)
        if len(key) > MAX_KEY_LENGTH:
            raise ValueError(
                f"namespace {self.namespace!r}: key is {len(key)} characters, "
                f"over the limit of {MAX_KEY_LENGTH}"
            )
        return key

    def _text(self, name: str, value: object) -> str:
        kind = type(value)
        if kind is int:
            return str(value)
        if kind is str:
            text: str = value  # type: ignore[assignment]
            if len(text) <= MAX_KEY_LENGTH and _SAFE_VALUE.fullmatch(text):
                return text
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise ValueError(
                f"namespace {self.namespace!r}: field {name!r} = {shown!r} is not a safe "
                f"key value (1..{MAX_KEY_LENGTH} of {_SAFE_DESCRIPTION})"
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
