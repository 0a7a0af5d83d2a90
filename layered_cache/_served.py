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
namespace's ``Policy.marks``: its L1's tombstones, or ``KeyTombstones`` without L1), or
saw a tag of the loaded value invalidated since (``TagVersions``' generation). A write
here records it before it submits its purge (``_coherence``, ``_writes``), so a
response built after that purge went out knows; another instance's, once the
backplane brings it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from layered_cache._tag_args import tag_names

if TYPE_CHECKING:
    from layered_cache._failsafe import Read
    from layered_cache._namespace_versions import NamespaceVersions
    from layered_cache._policy import Policy

__all__ = ["KeyTombstones", "Served", "served_of"]

_MAX_TOMBSTONES = 10_000  # as L1's (``_l1``)


class Served(msgspec.Struct):
    """``value``; ``superseded``: a write or an invalidation of the key (or of a tag of
    the value) overtook its load (the fill was refused, or this instance saw it);
    ``owned``: the loader's own object, stored nowhere."""

    value: Any
    superseded: bool = False
    owned: bool = False


class KeyTombstones:
    """Which keys this instance saw invalidated or written, and when, for a namespace
    without L1 (an L1 keeps these for its fills: ``L1Cache``, the same interface). Else
    nothing there recorded it, and a read the write overtook went out with
    ``s-maxage`` after the write's purge. A read takes ``begin_read`` as it begins
    (an attribute read); bounded as L1's: past ``_MAX_TOMBSTONES`` they become a floor
    (every read begun before it counts as overtaken: conservative, never wrong)."""

    def __init__(self) -> None:
        # No lock: unlike L1 (whose hits the sync API reads from its callers' threads),
        # these are read and changed on the cache's event loop only, where reads and
        # invalidations (local, or from the backplane listener) run.
        self._seq = 0
        self._floor = 0
        self._tombstones: dict[str, int] = {}

    def begin_read(self) -> int:
        return self._seq

    def invalidated_since(self, key: str, read_seq: int) -> bool:
        return read_seq < self._floor or self._tombstones.get(key, -1) > read_seq

    def discard(self, keys: Iterable[str]) -> int:
        """Tombstone ``keys``; 0: nothing held was dropped (``L1Cache.discard``'s count)."""
        self._seq += 1
        seq, tombstones = self._seq, self._tombstones
        for key in keys:
            tombstones[key] = seq
        if len(tombstones) > _MAX_TOMBSTONES:
            tombstones.clear()
            self._floor = seq
        return 0

    def clear(self) -> None:
        """Every read in flight counts as overtaken (the backplane lost track)."""
        self._seq += 1
        self._tombstones.clear()
        self._floor = self._seq


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
