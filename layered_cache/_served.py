"""What a read served, for callers that hand the value on to shared caches (the HTTP
layer, ``asgi.CachedResponses``).

Why: the caller of a read may always have the value it asked for, even one a write
overtook while it loaded (the read began first). A gateway that keeps the response is
another matter: the write's purge went out before this response, so nothing would
purge it again and the gateway would serve the old value for its whole ``s-maxage``.
And a value that could not be encoded is the loader's own object, stored nowhere: its
owner may change it in place, so nothing may be keyed on its identity (``http.ETags``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from layered_cache._failsafe import Read
    from layered_cache._policy import Policy

__all__ = ["Served", "served_of"]


class Served(msgspec.Struct):
    """``value``; ``superseded``: a write or an invalidation of the key overtook its
    load (the fill was refused, or this instance saw the key invalidated meanwhile);
    ``owned``: the loader's own object, stored nowhere."""

    value: Any
    superseded: bool = False
    owned: bool = False


def served_of(policy: Policy, read: Read, value: Any) -> Served:
    """``value`` as ``Served``: superseded if its fill was refused or this instance saw
    the key invalidated since the read began (its L1 tombstones say so)."""
    l1, seq = policy.l1, read.seq
    overtaken = read.revoked or (
        l1 is not None and seq is not None and l1.invalidated_since(read.key, seq)
    )
    return Served(value, overtaken, read.owned)
