"""Which Redis errors are about a key, a slot or the node: what the circuit breakers
count (``L2Store``). A node failure counts against its breaker like a timeout; an error
about one key (or one slot, for as long as it moves) is no reason to skip Redis for
every other key of the node.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from layered_cache._direct import ReplyTooLarge

__all__ = ["is_key_error", "moving_as_replies", "slot_moving"]

# Error replies that speak for the whole node (a replica after failover, cluster down,
# ...): they count against the breaker like a timeout. Every other error reply
# (WRONGTYPE, a script error) is about one key: the node answered, so it is no reason to
# skip Redis for every other key. Nor is OOM (a full Redis under noeviction): it refuses
# writes only, while reads and the DELs of an invalidation still work, and an open
# breaker would refuse those too (docs/operations.md, "Redis under memory pressure").
_NODE_REPLIES = (ReadOnlyError, ClusterDownError, NoScriptError)
_NODE_REPLY_PREFIXES = ("BUSY", "LOADING", "MASTERDOWN", "NOAUTH", "READONLY")


def is_key_error(exc: BaseException) -> bool:
    """Whether a Redis error is about one key (the node is fine), not about the node."""
    if isinstance(exc, ReplyTooLarge):
        return True  # its value, not the node (``L2Store.get``)
    if slot_moving(exc):
        return True
    return (
        isinstance(exc, ResponseError)
        and not isinstance(exc, _NODE_REPLIES)
        and not str(exc).startswith(_NODE_REPLY_PREFIXES)
    )


def slot_moving(exc: BaseException) -> bool:
    """A slot in migration (a reshard, a master added): TRYAGAIN (a command on names of
    the slot split between its two masters), an ASK, or redis-py giving up on redirects
    ("TTL exhausted": its asyncio client sends ASKING on another pooled connection than
    the command, so the target sends it back). About the slot's keys, for as long as
    the slot moves: counted against a breaker it opened it for every key of the master
    (for every multi-key operation of the cluster, with the shared one) during a
    routine operation (docs/operations.md, "Resharding")."""
    if isinstance(exc, TryAgainError | AskError):  # MovedError is an AskError
        return True
    return isinstance(exc, ClusterError) and "TTL exhausted" in str(exc)


async def moving_as_replies(pipe: Any) -> list[Any]:
    """A cluster pipeline's replies, where a command on a slot in migration
    (``slot_moving``) gets its error as its reply instead of failing the others: one
    moving slot among a master's keys made every key of the round trip unknown (a
    batch's MGET, leases and fills, a tagged batch's versions), where a reshard is to
    cost the moving slot's keys only (docs/operations.md, "Resharding"). Any other
    error is raised, for ``L2Store.guard`` to judge."""
    replies = await pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and not slot_moving(reply):
            raise reply
    return list(replies)
