"""The ``tags=`` argument: a list of tag names, or a function of the loaded value that
returns one (docs/tags.md). Each wrong kind is a ``TypeError`` that says what ``tags``
must be: read as it comes, bytes (a header, a Redis reply) were a tag per byte ("a tag
must be a string, not int: 98"), and a tags function that forgot its ``return`` or was
``async`` failed after the load with "'NoneType' object is not iterable" or
"'coroutine' object is not iterable", naming neither tags nor the function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from layered_cache._codec import MAX_TAGS

__all__ = ["TagsOf", "entry_tags", "refuse_async_tags", "tag_names"]

# A value's tags: a list, or a function of the loaded value (``lambda page: [...]``).
TagsOf = Iterable[str] | Callable[[Any], Iterable[str]]


def tag_names(tags_of: TagsOf, value: Any) -> list[str]:
    """The tags of ``value``: ``tags_of`` itself, or what it returns for the value."""
    if callable(tags_of):
        return entry_tags(_returned(tags_of(value)))
    return entry_tags(_listed(tags_of))


def refuse_async_tags(tags_of: object) -> None:
    """Refused before the load runs: an async tags function returns a coroutine, which
    nothing here awaits (the sync API refuses an async loader alike)."""
    if inspect.iscoroutinefunction(tags_of):
        name = getattr(tags_of, "__qualname__", tags_of)
        raise TypeError(
            f"tags must be a plain function of the value, not the async function {name!r}: "
            "its coroutine is never awaited; look its tags up in the loader instead"
        )


def entry_tags(names: Iterable[str]) -> list[str]:
    """One entry's tags, each once; more than ``MAX_TAGS`` (``_codec``: an envelope with
    more doesn't decode, it was planted) is a clear error, before anything is written.
    A list page tags what it shows: tens, not thousands."""
    unique = list(dict.fromkeys(names))
    if len(unique) > MAX_TAGS:
        raise ValueError(f"an entry carries at most {MAX_TAGS:,} tags, got {len(unique):,}")
    return unique


def _returned(names: object) -> Iterable[str]:
    """What a tags function returned, if tags can be read from it: not None (a
    forgotten ``return``), nor an awaitable (an ``async def __call__`` the up-front
    check can't see), closed so that it warns of no coroutine never awaited."""
    if inspect.isawaitable(names) or not isinstance(names, Iterable):
        if inspect.iscoroutine(names):
            names.close()
        got = "None" if names is None else type(names).__name__
        raise TypeError(f"the tags function must return a list of strings, got {got}")
    return _listed(names)


def _listed(names: object) -> Iterable[str]:
    """``names`` if it is a list of tags: a string or bytes would be read as one tag per
    character or byte."""
    if isinstance(names, str | bytes | bytearray):
        kind = "the string" if isinstance(names, str) else type(names).__name__
        raise TypeError(f"tags must be a list of strings, not {kind} {names[:80]!r}")
    if not isinstance(names, Iterable):
        raise TypeError(
            "tags must be a list of strings or a function of the value, "
            f"got {type(names).__name__}"
        )
    return names
