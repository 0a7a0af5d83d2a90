"""Rules for the names a config gives the library: the backplane stream (a name in the
reserved segment that no name the library builds can equal) and the HTTP caches to
purge (a URL a purge can be sent to)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from layered_cache._keys import (
    RESERVED_SEGMENT,
    hot_report_name,
    loading_set_name,
    tag_version_name,
)

__all__ = ["purge_url_problem", "stream_problem"]


def _owned(name: str) -> str:
    """The first segment after ``layered_cache:`` of a name the library builds there."""
    return name.removeprefix(RESERVED_SEGMENT).split(":", 1)[0]


# What the library itself names in the reserved segment (``_keys.py``), by the first
# segment after ``layered_cache:``; the backplane stream may be any other name there.
# (The other owned names can't collide: leases, fill channels and the replica record
# contain braces, replicas a '#', keys never start with the reserved segment.)
_OWNED_SEGMENTS = {
    _owned(loading_set_name("")): "loading set of tagged loads (layered_cache:loading)",
    _owned(tag_version_name("", "t")): "tag versions (layered_cache:tag:<tag>)",
    _owned(hot_report_name("", "i")): "hot-key reports (layered_cache:hotkeys:<instance>)",
}
# Segments of the key-value characters but ':' (no '{' '}' '#' '%', no SCAN glob).
_STREAM_SEGMENT = re.compile(r"[A-Za-z0-9_.@/=+\-]+")
_MAX_STREAM = 128


def stream_problem(stream: str) -> str | None:
    """Why ``backplane.stream`` could be (or become) a name the library builds, if so."""
    if not stream.startswith(RESERVED_SEGMENT):
        # Keys can never start with the reserved segment (docs/keys.md), so a stream
        # inside it can never be a cache key that set() would overwrite.
        return f"must start with the reserved {RESERVED_SEGMENT!r}, got {stream!r}"
    if len(stream) > _MAX_STREAM:
        return f"{stream[:40]!r}... is over {_MAX_STREAM} characters"
    rest = stream.removeprefix(RESERVED_SEGMENT)
    if not rest:
        return f"{stream!r} needs a name after {RESERVED_SEGMENT!r}, e.g. 'invalidations'"
    segments = rest.split(":")
    if not all(segments):
        return f"{stream!r} has an empty segment ('::' or a trailing ':')"
    if not all(_STREAM_SEGMENT.fullmatch(segment) for segment in segments):
        return (
            f"{stream!r} may only contain letters, digits and _ . : @ / = + - "
            "('#', '{', '}' belong to replica, lease and channel names)"
        )
    if (owned := _OWNED_SEGMENTS.get(segments[0])) is not None:
        return (
            f"{stream!r} is named like the library's own {owned}, a different Redis type: "
            f"its first segment after {RESERVED_SEGMENT!r} may be anything but "
            f"{', '.join(map(repr, _OWNED_SEGMENTS))} (the default is "
            f"'layered_cache:invalidations')"
        )
    return None


def purge_url_problem(url: str) -> str | None:
    """What makes ``url`` (http:// or https://) one no purge could be sent to."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number
    except ValueError:
        return "has a port that is no number (or a bad [host])"
    return None if parts.hostname else "needs a host (http://varnish:6081)"
