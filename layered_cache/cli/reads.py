"""The CLI's reads of cache keys, through the cache's ``L2Store`` and its circuit
breakers instead of the raw client.

Values (a base key, a lease holder) are read with ``L2Store.get``, exactly as the
service reads them. PTTL and EXISTS are commands the store does not have (yet): they go
through the same per-node breaker and connection bound as the store's own commands,
and fail the same way, as ``L2Unavailable`` wrapping the Redis error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from layered_cache._clients import REDIS_FAILURES
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache._replyerrors import is_key_error
from layered_cache.cli.common import CliError

__all__ = ["KeyReads", "OverReadCap"]

T = TypeVar("T")


class OverReadCap(CliError):
    """A string too large for the store's read (``redis.max_value_bytes`` caps what a
    GET reads): there, but no layered_cache value (a writer's never exceed it)."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(f"{name} holds {size:,} bytes, more than a read takes")
        self.size = size


class KeyReads:
    """Read-only views of cache keys for ``inspect``, ``invalidate`` and ``hotkeys``."""

    def __init__(self, store: L2Store) -> None:
        self._store = store

    async def get(self, name: str) -> bytes | None:
        """The value under ``name``, or None when there is none.

        The store reads a key of another Redis type (WRONGTYPE), or a string over its
        read cap, as a miss, which is right for a cache but would make ``inspect`` call
        a key absent that is there."""
        before = self._store.key_errors
        data = await self._store.get(name)
        if self._store.key_errors != before:
            client: Any = self._store.client
            if await self._guarded(name, lambda: client.type(name)) in (b"string", "string"):
                raise OverReadCap(name, await self._guarded(name, lambda: client.strlen(name)))
            raise CliError(
                f"{name} holds another Redis type than a string (WRONGTYPE): "
                "not a layered_cache value"
            )
        return data

    async def pttl(self, name: str) -> int:
        """PTTL in ms; -2: no such key, -1: no expiry."""
        client: Any = self._store.client
        return int(await self._guarded(name, lambda: client.pttl(name)))

    async def exists(self, name: str) -> bool:
        client: Any = self._store.client
        return bool(await self._guarded(name, lambda: client.exists(name)))

    async def _guarded(self, name: str, command: Callable[[], Awaitable[T]]) -> T:
        """``command()`` as the store runs its own: refused while ``name``'s node breaker
        is open, its outcome counted by that breaker (a per-key error reply is no node
        failure), any Redis failure raised as ``L2Unavailable``."""
        breaker = self._store.breakers.for_name(name)
        if not breaker.allow():
            raise L2Unavailable("circuit breaker open")
        try:
            async with self._store.slots:
                result = await command()
        except REDIS_FAILURES as exc:
            if is_key_error(exc):
                breaker.success()
            else:
                breaker.failure(exc)
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            breaker.abandon()  # cancelled: a half-open probe must not stay in flight
            raise
        breaker.success()
        return result
