"""Django cache keys as key field values: one name per Django key, readable when it can be.

Django hands a backend any string (``KEY_FUNCTION`` may return anything, with spaces,
non-ASCII, any length); a layered_cache key field takes 1..512 of ``A-Z a-z 0-9 _ . :
@ / = + -``. The field value of a Django key is, by its alphabet:

- readable: a key of 1..250 of ``A-Z a-z 0-9 _ . : @ + -`` (no ``/``, no ``=``) is kept,
  with every ``:`` written ``/`` (``:1:views.cache`` -> ``/1/views.cache``; the key rules
  would otherwise write ``:`` as ``%3A``);
- hashed: any other key is ``=`` + the hex SHA-256 of its UTF-8 bytes.

Injective: a readable value never contains ``=``, a hashed one starts with it, so the
two forms never meet. Within the readable form ``:`` -> ``/`` is undone by ``/`` -> ``:``
(readable keys hold no ``/``): ``django_key`` is its inverse. Within the hashed form two
keys share a value only if they share a SHA-256, which nobody knows how to find. Checked
by ``tests/test_django_keys.py`` (hypothesis).
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["MAX_READABLE", "django_key", "field_value"]

MAX_READABLE = 250  # memcached's limit, which portable Django code already keeps to
_READABLE = re.compile(rf"[A-Za-z0-9_.:@+\-]{{1,{MAX_READABLE}}}")
HASHED_MARK = "="


def field_value(key: str) -> str:
    """The key field value that names the Django key ``key`` (see the module doc)."""
    if _READABLE.fullmatch(key):
        return key.replace(":", "/")
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return HASHED_MARK + digest


def django_key(value: str) -> str | None:
    """The Django key a readable field value names; None for a hashed one (one-way)."""
    if value.startswith(HASHED_MARK):
        return None
    return value.replace("/", ":")
