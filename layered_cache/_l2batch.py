"""Multi-key Redis operations of a batch (``get_many``, ``get_or_load_many``): one round
trip on a single node, one per master in a cluster.

Every operation goes through ``L2Store.guard``: a breaker, the concurrency bound, and
failures as ``L2Unavailable``. On a single node it is one operation under the shared
breaker. In a cluster the batch's names are split by master (the client's slot map,
``NodeBreakers.by_master``) and each master's part runs under that master's breaker,
the masters concurrently. Why: sent as one operation (an ``mget_nonatomic``, a pipeline
redis-py splits per node), one slow or dead master failed all of it and counted against
the shared breaker, so its failure sent every key of the batch to the database and
could open the breaker every multi-master operation of the instance uses. Now only its
own keys fail (``Replies.failed``; the callers load them without writing L2, as a
single read does when its master is down), and the operation raises only when no
master answered.

Scripts go as EVAL, not EVALSHA: cluster pipelines refuse EVALSHA, and Redis caches the
compiled script by its SHA anyway.

A large batch goes in round trips of at most 1,000 keys (fills: also about 1 MB of
values), each under one ``redis.timeout`` (``_chunks`` says why). A master's round trips
go one after another, and its first failure ends its part: the next one would wait the
same timeout (or meet the breaker it just opened).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from layered_cache import _direct as direct
from layered_cache._chunks import by_count, by_size
from layered_cache._keys import fill_channel
from layered_cache._l2 import BreakerOpen, L2Store, L2Unavailable, LeaseRefused
from layered_cache._replyerrors import moving_as_replies
from layered_cache._scripts import FILL_SCRIPT, RELEASE_SCRIPT, fill_args

__all__ = ["Fill", "L2Batch", "Replies"]

Fill = tuple[str, str, bytes, int]  # (key, its lease, envelope bytes, ttl in ms)
# One round trip, by positions: those of a slot in migration come back (unknown).
Send = Callable[[Sequence[int]], Awaitable[list[int]]]
Cut = Callable[[Sequence[int]], Iterator[Sequence[int]]]  # positions into round trips

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Replies(Generic[T]):
    """One reply per name, in order. ``failed``: the positions whose master failed, or
    whose slot was moving (a cluster): their reply is unknown, left at the default
    (None, False)."""

    values: list[T]
    failed: frozenset[int] = frozenset()


class L2Batch:
    def __init__(self, store: L2Store) -> None:
        self._store = store

    async def get_many(self, names: Sequence[str]) -> Replies[bytes | None]:
        """The values of ``names`` in order (None: missing, not a string, or failed)."""
        store = self._store
        if not store.cluster:
            # Packed and parsed by ``_direct``, on a kept connection: redis-py's parser
            # awaits the stream once per value (50 of them on a list page), and its pool
            # checkout and ``wait_for`` cost as much again (``_direct``).
            assert store.direct is not None
            found: list[bytes | None] = []
            for chunk in by_count(names):
                found += await store.guard(direct.execute_command(store.direct, "MGET", *chunk))
            return Replies(found)
        values: list[bytes | None] = [None] * len(names)
        keyslot = store.client.keyslot  # type: ignore[union-attr]

        async def send(run: Sequence[int]) -> list[int]:
            # One pipelined MGET per slot, all on this part's master (as
            # ``mget_nonatomic`` sends them, which fails them all for one moving slot).
            slots: dict[int, list[int]] = {}
            for i in run:
                slots.setdefault(keyslot(names[i]), []).append(i)
            pipe = store.client.pipeline(transaction=False)
            for positions in slots.values():
                pipe.execute_command("MGET", *(names[i] for i in positions))
            replies = await self._replies(pipe, [names[i] for i in run])
            moving: list[int] = []
            for positions, reply in zip(slots.values(), replies, strict=True):
                if isinstance(reply, Exception):
                    moving += positions
                    continue
                for i, value in zip(positions, reply, strict=True):
                    values[i] = value
            return moving

        return Replies(values, await self._per_master(names, send))

    async def acquire_leases(self, leases: Sequence[str], token: str, ttl_ms: int) -> Replies[bool]:
        """SET NX PX every lease with one token: which ones we hold now. A failure may
        come after some round trips (or some commands of one) took theirs: the caller
        gives back every lease it asked for and doesn't hold for sure, the failed ones
        (a compare-and-delete by ``token``). Raises ``LeaseRefused`` when an open breaker
        refused every round trip: nothing was sent, nothing to give back (during an
        outage every batch sent its give-backs past the breaker for nothing)."""
        held = [False] * len(leases)
        sent = False

        async def send(run: Sequence[int]) -> list[int]:
            nonlocal sent
            pipe = self._store.client.pipeline(transaction=False)
            for i in run:
                pipe.set(leases[i], token, nx=True, px=ttl_ms)
            try:
                replies = await self._replies(pipe, [leases[i] for i in run])
            except BreakerOpen:
                raise  # refused before anything went out
            except BaseException:
                sent = True  # maybe sent: some SET NX may have landed
                raise
            sent = True
            for i, won in zip(run, replies, strict=True):
                held[i] = not isinstance(won, Exception) and bool(won)
            return _moving(run, replies)

        try:
            return Replies(held, await self._per_master(leases, send))
        except L2Unavailable as exc:
            if not sent:  # every round trip refused by an open breaker: none to give back
                raise LeaseRefused(str(exc)) from exc
            raise

    async def fill_many(self, fills: Sequence[Fill], token: str) -> Replies[bool]:
        """Each key written only while ``token`` holds its lease (the FILL script, which
        also releases the lease and wakes the key's waiters): which ones were written."""
        cluster, db = self._store.cluster, self._store.db
        written = [False] * len(fills)

        async def send(run: Sequence[int]) -> list[int]:
            pipe = self._store.client.pipeline(transaction=False)
            for i in run:
                key, lease, data, ttl_ms = fills[i]
                args = fill_args(token, data, ttl_ms, fill_channel(key, db), True, cluster)
                pipe.eval(FILL_SCRIPT, 2, key, lease, *args)
            replies = await self._replies(pipe, [fills[i][0] for i in run])
            for i, done in zip(run, replies, strict=True):
                written[i] = not isinstance(done, Exception) and bool(done)
            return _moving(run, replies)

        def cut(positions: Sequence[int]) -> Iterator[Sequence[int]]:
            return by_size(positions, lambda i: len(fills[i][2]))

        keys = [fill[0] for fill in fills]  # a key and its lease share a slot
        return Replies(written, await self._per_master(keys, send, cut))

    async def release_many(self, leases: Sequence[str], token: str) -> list[str]:
        """Compare-and-delete each lease still holding ``token``. Returns those an open
        breaker refused, unsent (``_giveback`` sends them past it); a failed master's
        expire by themselves (``lease_ttl``)."""
        refused: list[str] = []

        async def send(run: Sequence[int]) -> list[int]:
            pipe = self._store.client.pipeline(transaction=False)
            for i in run:
                pipe.eval(RELEASE_SCRIPT, 1, leases[i], token)
            try:
                replies = await self._replies(pipe, [leases[i] for i in run])
            except BreakerOpen:
                refused.extend(leases[i] for i in run)
                return []
            return _moving(run, replies)

        with contextlib.suppress(L2Unavailable):
            await self._per_master(leases, send)
        return refused

    async def _per_master(
        self, names: Sequence[str], send: Send, cut: Cut = by_count
    ) -> frozenset[int]:
        """``send`` each round trip (``cut``) of each master's positions of ``names``: a
        master's in order, the masters concurrently. Returns the positions of the masters
        whose part failed, from its failed round trip on, and those of slots in
        migration; raises ``L2Unavailable`` when nothing got through (the one part of a
        single node or of a batch on one master, or every slot moving)."""
        groups = self._store.breakers.by_master(names)
        if len(groups) <= 1:
            moving: list[int] = []
            for run in cut(groups[0] if groups else []):
                moving += await send(run)
            if moving and len(moving) == len(names):
                raise L2Unavailable("every slot of the batch is moving")
            return frozenset(moving)
        # gather, not a TaskGroup: a master's failure (``_part`` returns it) must not
        # cancel the others' parts. Anything else (a bug, a CancelledError of a part)
        # is raised once every part ended; our own cancellation cancels them all.
        parts = await asyncio.gather(
            *(_part(group, send, cut) for group in groups), return_exceptions=True
        )
        failed: list[int] = []
        for part in parts:
            if isinstance(part, BaseException):
                raise part
            failed += part
        if len(failed) == len(names):
            raise L2Unavailable("no master of the batch answered")
        return frozenset(failed)


    async def _replies(self, pipe: Any, names: list[str]) -> list[Any]:
        """The pipeline's replies under the breaker of ``names``' master; in a cluster a
        moving slot's commands get their error as their reply (``moving_as_replies``)."""
        store = self._store
        operation = moving_as_replies(pipe) if store.cluster else pipe.execute()
        return list(await store.guard(operation, names=names))


def _moving(run: Sequence[int], replies: list[Any]) -> list[int]:
    """The positions of ``run`` whose reply is an error (a slot in migration)."""
    return [i for i, reply in zip(run, replies, strict=True) if isinstance(reply, Exception)]


async def _part(positions: list[int], send: Send, cut: Cut) -> list[int]:
    """One master's round trips, in order: the positions from its first failure on, and
    those of slots in migration before it."""
    sent, moving = 0, []
    try:
        for run in cut(positions):
            moving += await send(run)
            sent += len(run)
    except L2Unavailable:
        return moving + positions[sent:]
    return moving
