"""The loading set: tagged loads in flight, which ``invalidate_tag`` revokes.

A tagged load registers its lease (with its token) in ``{prefix}layered_cache:loading``
before it calls the loader: its tags come from the loaded value, so they aren't known
before. ``invalidate_tag`` reads the set, deletes those leases, then removes exactly
those members, before it writes the new token (``_tags`` says why that order): a fill
whose load began before the invalidation finds its lease gone and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from layered_cache._keys import loading_set_name
from layered_cache._l2 import L2Store, L2Unavailable

__all__ = ["Loading", "loading_members", "take_loading"]


async def take_loading(store: L2Store, prefix: str) -> None:
    """Revoke the leases of every tagged load registered so far (see the module doc).

    Three steps, and a member leaves the set only once its lease is gone: an attempt
    that fails after any of them (a reply lost, the DEL refused, a cluster node down)
    leaves the members for its retry to revoke. Taking them (SMEMBERS and DEL in one
    script) before the lease DEL let a failed attempt empty the set with the leases
    still held, and the retry revoked nothing. Not one script for all: in a cluster
    the leases live in their keys' slots, not the set's. A member registered after the
    SMEMBERS stays (SREM of the members read, not DEL of the set): its load began after
    the read, so after the change that caused this invalidation."""
    loading = loading_set_name(prefix)
    members = list(await store.guard(store.client.smembers(loading), loading))
    if not members:
        return
    await store.delete(list(dict.fromkeys(_lease_of(member) for member in members)))
    await store.guard(store.client.srem(loading, *members), loading)


class Loading:
    """The loading set's members: tagged loads in flight (see the module doc)."""

    def __init__(
        self, store: L2Store, prefix: str, spawn: Callable[[Awaitable[Any]], None]
    ) -> None:
        self._store = store
        self._name = loading_set_name(prefix)
        self._spawn = spawn

    async def enter(self, leases: list[str], token: str) -> None:
        """Before a tagged load starts: its leases join the set ``invalidate`` revokes.
        Raises ``L2Unavailable`` (the load must then not write L2). Failed or cancelled,
        it takes them out again: its SADD may have landed (a reply later than
        ``redis.timeout``), and the set has no TTL: each such blip left a member per
        load until some ``invalidate_tag`` ran."""
        members = loading_members(leases, token)
        try:
            await self._store.guard(self._store.client.sadd(self._name, *members), self._name)
        except (asyncio.CancelledError, L2Unavailable):
            self._spawn(self._leave(members))
            raise

    def leave(self, leases: list[str], token: str) -> None:
        """After the fill (or the failure): in the background, off the caller's latency.
        A member left behind (Redis down) is harmless: the next invalidate takes it."""
        self._spawn(self._leave(loading_members(leases, token)))

    async def _leave(self, members: list[str]) -> None:
        with contextlib.suppress(L2Unavailable):
            await self._store.guard(self._store.client.srem(self._name, *members), self._name)


def loading_members(leases: list[str], token: str) -> list[str]:
    """Each load's own members: ``<lease> <token>``. By lease name alone, a slow load
    whose lease expired and was taken by another load of the key removed the newer
    load's registration when it left (SREM of the same name), and ``invalidate_tag``
    then let that newer load land. A space can't occur in a name (``_keys``)."""
    return [f"{lease} {token}" for lease in leases]


def _lease_of(member: bytes | str) -> str:
    """The lease of a loading-set member (a bare lease name from earlier versions)."""
    text = member.decode() if isinstance(member, bytes) else member
    return text.rpartition(" ")[0] or text
