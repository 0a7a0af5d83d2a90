"""What a read served, for callers that hand the value on to shared caches (the HTTP
layer, ``asgi.CachedResponses``).

Why: the caller of a read may always have the value it asked for, even one a write
overtook while it loaded (the read began first). A gateway that keeps the response is
another matter: the write's purge went out before this response, so nothing would
purge it again and the gateway would serve the old value for its whole ``s-maxage``.
And a value that could not be encoded is the loader's own object, stored nowhere: its
owner may change it in place, so nothing may be keyed on its identity (``http.ETags``).

How a read learns that a write overtook it: its fill was refused (``Read.revoked``),
or this instance saw the key invalidated or written since the read began (the
namespace's ``Policy.marks``: its L1's tombstones, or without L1 ``KeyTombstones``:
``_tombstones``), or saw a tag of the loaded value invalidated since (``TagVersions``'
generation). A write here records it before it submits its purge (``_coherence``, ``_writes``), so a
response built after that purge went out knows; another instance's, once the
backplane brings it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from layered_cache._tag_args import tag_names

if TYPE_CHECKING:
    from layered_cache._failsafe import Read
    from layered_cache._namespace_versions import NamespaceVersions
    from layered_cache._policy import Policy

__all__ = ["Served", "served_of"]

class Served(msgspec.Struct):
    """``value``; ``superseded``: a write or an invalidation of the key (or of a tag of
    the value) overtook its load (the fill was refused, or this instance saw it);
    ``owned``: the loader's own object, stored nowhere."""

    value: Any
    superseded: bool = False
    owned: bool = False


def served_of(policy: Policy, versions: NamespaceVersions, read: Read, value: Any) -> Served:
    """``value`` as ``Served``: superseded if its fill was refused, or this instance saw
    the key (``Policy.marks``), or a tag of the value, invalidated since the read began."""
    seq = read.seq
    overtaken = (
        read.revoked
        or (seq is not None and policy.marks.invalidated_since(read.key, seq))
        or _tag_overtaken(versions, read, value)
    )
    return Served(value, overtaken, read.owned)


def _tag_overtaken(versions: NamespaceVersions, read: Read, value: Any) -> bool:
    """Whether a tag of ``value`` was invalidated here since ``read`` began. A load that
    held no lease (``max_wait`` passed, Redis failed, ``l2 = false``) is revoked by
    nothing, and ``invalidate_tag`` drops from L1 only the keys L1 holds, not one being
    loaded. One comparison unless some tag was invalidated meanwhile; only then are the
    value's tags read."""
    generation, tags_of = read.generation, read.tags_of
    if generation is None or tags_of is None or versions.generation == generation:
        return False
    try:
        names = tag_names(tags_of, value)
    except Exception:
        # Not judged here: ``CachedResponses.respond`` raises it from its own call, as
        # on any hit (taken as overtaken, the no-store answer went out and it was lost).
        return False
    return versions.invalidated_since(names, generation)
