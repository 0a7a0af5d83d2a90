"""Key names back to their field values: the splitting half of ``KeyTemplate.parse``.

Its own module so that ``_keys`` stays the one place names are *built*; what this
returns is checked there by building it again (a name ``build`` can't produce from the
fields found is no name of the template).
"""

from __future__ import annotations

import re

__all__ = ["split_name"]

# A field value as it appears in a name: the safe characters, ``:`` written ``%3A``.
_ENCODED_VALUE = re.compile(r"(?:[A-Za-z0-9_.@/=+\-]|%3A)+")


def split_name(
    literals: tuple[str, ...], fields: tuple[str, ...], name: str
) -> dict[str, str] | None:
    """``name`` cut at the template's literals (``literals[0]`` includes the prefix) into
    decoded field values, or None if the literals don't fit it."""
    if not name.startswith(literals[0]):
        return None
    position = len(literals[0])
    values: dict[str, str] = {}
    last = len(fields) - 1
    for index, field in enumerate(fields):
        after = literals[index + 1]
        if index < last:
            # The value holds no ':', so the first ':' ahead is the template's.
            colon = name.find(":", position)
            end = colon - after.index(":")
            if colon < 0 or not name.startswith(after, end):
                return None
        else:
            end = len(name) - len(after)
            if not name.endswith(after):
                return None
        text = name[position:end] if end > position else ""
        if not _ENCODED_VALUE.fullmatch(text):
            return None
        values[field] = text.replace("%3A", ":")
        position = end + len(after)
    return values if position == len(name) else None
