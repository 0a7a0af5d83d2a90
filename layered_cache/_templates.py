"""Template text and the characters of names: ``book:{id}:{lang}`` split into its
literals and field names, and the rules a template obeys so that its names are one per
value and never reserved (docs/keys.md, "Rules"). ``_keys.KeyTemplate`` compiles a
template with these.
"""

from __future__ import annotations

import re

__all__ = [
    "FIELD_NAME", "RESERVED_SEGMENT", "SAFE_DESCRIPTION", "SAFE_LITERAL", "check_template",
    "parse_template",
]

# Names the library owns live in this segment after the prefix; no template reaches it.
RESERVED_SEGMENT = "layered_cache:"
SAFE_LITERAL = re.compile(r"[A-Za-z0-9_.:@/=+\-]*")
SAFE_DESCRIPTION = "letters, digits and _ . : @ / = + -"
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_template(namespace: str, template: str) -> tuple[list[str], list[str]]:
    """Split ``book:{id}:{lang}`` into literals and field names, saying what is wrong."""
    where = f"namespace {namespace!r}: template {template!r}"
    literals: list[str] = []
    fields: list[str] = []
    literal_start = 0
    position = 0
    while position < len(template):
        char = template[position]
        if char == "}":
            raise ValueError(f"{where}: '}}' at {position} closes no placeholder")
        if char != "{":
            position += 1
            continue
        close = template.find("}", position + 1)
        nested = template.find("{", position + 1)
        if close < 0 or 0 <= nested < close:
            raise ValueError(f"{where}: unclosed placeholder at {position} (missing '}}')")
        name = template[position + 1 : close]
        if not name:
            raise ValueError(f"{where}: empty placeholder '{{}}' at {position}")
        if not FIELD_NAME.fullmatch(name):
            raise ValueError(
                f"{where}: placeholder {{{name}}} is not a field name "
                "(letters, digits, _; not starting with a digit)"
            )
        literals.append(template[literal_start:position])
        fields.append(name)
        position = literal_start = close + 1
    literals.append(template[literal_start:])
    return literals, fields


def check_template(namespace: str, template: str, literals: list[str], fields: list[str]) -> None:
    where = f"namespace {namespace!r}: template {template!r}"
    if not template:
        raise ValueError(f"namespace {namespace!r} has an empty key template")
    for literal in literals:
        if not SAFE_LITERAL.fullmatch(literal):
            raise ValueError(
                f"{where}: text outside {{field}} placeholders may only contain {SAFE_DESCRIPTION}"
            )
    if len(set(fields)) != len(fields):
        raise ValueError(f"{where} repeats a field")
    lead = literals[0]
    if not lead:
        raise ValueError(
            f"{where}: must start with literal text such as '{namespace}:' "
            "so namespaces can't collide"
        )
    if lead.startswith(RESERVED_SEGMENT) or RESERVED_SEGMENT.startswith(lead):
        raise ValueError(
            f"{where}: could build names in the reserved {RESERVED_SEGMENT!r} segment "
            "(backplane stream, fleet hashes); start it with other text"
        )
    for between in literals[1:-1]:
        if ":" not in between:
            raise ValueError(
                f"{where}: placeholders must be separated by text containing ':' "
                "(e.g. '{a}:{b}'), else two different field values could build one name"
            )
