"""The load half of ``get_or_load_many``: the keys this call claimed are read in one
MGET; the misses take their leases in one round trip; the won keys load in one
``load_many`` call and fill in one pipeline (``_batch_fill``); the lost keys go to the
single-key miss path, which waits for the holder's fill as a ``get_or_load`` would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

from layered_cache._batch_fill import BatchFill
from layered_cache._batch_read import BatchReader
from layered_cache._codec import Envelope
from layered_cache._failsafe import Misshapen
from layered_cache._fills import Fills
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable, LeaseRefused
from layered_cache._l2batch import L2Batch
from layered_cache._miss import MissPath, Read, awaited, call_loader
from layered_cache._policy import Policy
from layered_cache._refresh import Refresher
from layered_cache._runtime import Runtime
from layered_cache._stampede import new_token

__all__ = ["BatchLoader", "Fields", "LoadMany", "checked", "one_loader"]

Fields = Mapping[str, object]
LoadMany = Callable[[list[Fields]], Awaitable[Sequence[Any]]]


class BatchLoader:
    def __init__(
        self,
        policy: Policy,
        fills: Fills,
        miss: MissPath,
        refresher: Refresher,
        runtime: Runtime,
        reader: BatchReader,
        batch: L2Batch,
    ) -> None:
        self._policy = policy
        self._fills = fills
        self._miss = miss
        self._refresher = refresher
        self._rt = runtime
        self._reader = reader
        self._batch = batch
        self._fill = BatchFill(policy, fills, miss, runtime, batch)

    async def fetch_many(
        self,
        reads: dict[str, Read],
        fields_of: dict[str, Fields],
        load_many: LoadMany,
        on_hits: Callable[[dict[str, Any]], None] = lambda hits: None,
    ) -> dict[str, Any]:
        """The values of ``reads`` (begun together), which keep what ``Served`` says.
        ``on_hits`` hears the L2 hits before the misses load: their joiners need not wait
        for ``load_many``, which may itself read them (and would wait for itself)."""
        policy, seq = self._policy, next(iter(reads.values())).seq
        if not policy.l2:
            return await self._load_l1_only(reads, fields_of, load_many)
        try:
            envelopes = await self._reader.read_many(list(fields_of))
        except L2Unavailable:
            envelopes = {}
        if len(envelopes) < len(reads):  # Redis, or a cluster master, failed
            policy.stats.redis_error += 1
            policy.stats.miss += len(reads) - len(envelopes)  # unread: the loader answers
        if not envelopes:
            return await self._load_unleased(list(reads.values()), fields_of, load_many)
        found: dict[str, Any] = {}
        hits: list[tuple[Read, Envelope[Any]]] = []
        now = self._rt.clock()
        for key, envelope in envelopes.items():
            if envelope is not None and now < envelope.soft_expiry:
                policy.stats.l2_hit += 1
                hits.append((reads[key], envelope))
                self._fills.fill_l1(key, envelope.value, envelope.soft_expiry, seq, envelope.tags)
                found[key] = envelope.value
            else:
                policy.stats.miss += 1
                reads[key].stale = envelope if self._fills.within_stale(envelope, now) else None
        misses = [read for key, read in reads.items() if key in envelopes and key not in found]
        unread = [read for key, read in reads.items() if key not in envelopes]
        if misses or unread:
            on_hits(found)
            found.update(await self._load_misses(misses, unread, fields_of, load_many))
        # Early refreshes only once the batch succeeded: each calls ``load_many`` in the
        # background, and a batch that raised leaves nothing that would call it after.
        for read, envelope in hits:
            loader = one_loader(policy.name, fields_of[read.key], load_many)
            self._refresher.maybe_refresh_early(read, envelope, loader, now)
        return found

    async def _load_l1_only(
        self, reads: dict[str, Read], fields_of: dict[str, Fields], load_many: LoadMany
    ) -> dict[str, Any]:
        """The misses of an ``l2 = false`` namespace: one load, then fill L1."""
        first = next(iter(reads.values()))
        self._policy.stats.miss += len(reads)
        generation = self._fills.versions.generation
        values = await self.call(load_many, list(fields_of.values()))
        loaded = [(key, first.seq, value) for key, value in zip(fields_of, values, strict=True)]
        await self._fills.fill_l1_only(loaded, first.tags_of, generation)
        return dict(zip(fields_of, values, strict=True))

    async def _load_misses(
        self,
        reads: list[Read],
        unread: list[Read],
        fields_of: dict[str, Fields],
        load_many: LoadMany,
    ) -> dict[str, Any]:
        """Take every miss's lease in one round trip; load the won keys in one call and
        hand the lost ones to the single-key path (it waits for the holder's fill).
        ``unread``, and misses whose lease a failed master couldn't give, load in a call
        of their own without writing L2, as a single read does when its master is down."""
        policy = self._policy
        token = new_token()
        ttl_ms = max(1, int(policy.lease_ttl * 1000))
        try:
            held = await self._batch.acquire_leases(
                [lease_name(r.key) for r in reads], token, ttl_ms
            )
        except L2Unavailable as exc:
            policy.stats.redis_error += 1
            if not isinstance(exc, LeaseRefused):  # refused unsent: none to give back
                self._fill.give_back(reads, token)  # some SET NXs may have landed: _l2batch
            return await self._load_unleased(reads + unread, fields_of, load_many)
        except asyncio.CancelledError:
            self._fill.give_back(reads, token)  # the SET NXs may have landed before the cancel
            raise
        failed = [read for i, read in enumerate(reads) if i in held.failed]
        if failed:
            policy.stats.redis_error += 1
            self._fill.give_back(failed, token)  # as above, for their master's round trip
        won = [read for read, ours in zip(reads, held.values, strict=True) if ours]
        lost = [r for i, r in enumerate(reads) if not held.values[i] and i not in held.failed]
        # Not counted here: each lost key's ``load_under_lease`` asks again and counts
        # what it gets (lost, or won once the holder gave up), once per key.
        waits = [self._get_or_load_lost(r, fields_of[r.key], load_many) for r in lost]
        ours = [
            self._load_won(won, fields_of, load_many, token),
            self._load_unleased(unread + failed, fields_of, load_many),
        ]
        try:
            results = await all_or_none([*ours, *waits])
        except BaseException:
            # The lost keys' waits give back their own (``MissPath.load_under_lease``), and
            # a background fill those its keys handed it (served stale: ``handed_over``).
            self._fill.give_back([read for read in won if not read.handed_over], token)
            raise
        found: dict[str, Any] = {**results[0], **results[1]}
        found.update(zip((r.key for r in lost), results[2:], strict=True))
        return found

    async def _get_or_load_lost(self, read: Read, fields: Fields, load_many: LoadMany) -> Any:
        return await self._miss.load_under_lease(
            read, one_loader(self._policy.name, fields, load_many)
        )

    async def _load_won(
        self, reads: list[Read], fields_of: dict[str, Fields], load_many: LoadMany, token: str
    ) -> dict[str, Any]:
        if not reads:
            return {}
        found = await self._fill.filled_meanwhile(reads, token)
        todo = [read for read in reads if read.key not in found]
        if not todo:
            return found
        self._policy.stats.lease_won += len(todo)
        if not await self._fill.enter(todo, token):
            found.update(await self._load_unleased(todo, fields_of, load_many))
            return found
        load = self.call(load_many, [fields_of[r.key] for r in todo])
        found.update(await self._fill.load_and_fill(todo, token, load))
        return found

    async def _load_unleased(
        self, reads: list[Read], fields_of: dict[str, Fields], load_many: LoadMany
    ) -> dict[str, Any]:
        """Load without writing L2 (Redis unavailable): the type an L2 hit would give, in
        L1 all the same (``MissPath.kept_in_l1``)."""
        if not reads:
            return {}
        try:
            values = await self.call(load_many, [fields_of[r.key] for r in reads])
        except Exception as exc:
            return await self._miss.failsafe.serve_all_or_raise(reads, exc)
        return {r.key: self._miss.kept_in_l1(r, v) for r, v in zip(reads, values, strict=True)}

    async def call(self, load_many: LoadMany, fields_list: list[Fields]) -> Sequence[Any]:
        """``load_many`` through the loader hooks, counted once per key."""
        self._policy.stats.load += len(fields_list) - 1  # call_loader counts one
        values: Sequence[Any] = await call_loader(
            self._policy, self._rt.hooks, lambda: checked(self._policy.name, load_many, fields_list)
        )
        return values


async def all_or_none(parts: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every part's result, or the first error with the others cancelled: a batch's
    wait for a key another process loads must not run on after its caller has an error
    (it would call ``load_many`` for nobody once ``max_wait`` passed)."""
    tasks = [asyncio.ensure_future(part) for part in parts]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def checked(name: str, load_many: LoadMany, fields_list: list[Fields]) -> Sequence[Any]:
    """``load_many(fields_list)``, refused with a clear error unless it is one value per key."""
    keys = len(fields_list)  # before the call: a load_many may consume its argument
    values = await awaited(name, lambda: load_many(fields_list))
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise Misshapen(
            f"namespace {name!r}: load_many must return a list of values "
            f"(one per key, in order), not {type(values).__name__}"
        )
    if len(values) != keys:
        raise Misshapen(
            f"namespace {name!r}: load_many returned {len(values)} values "
            f"for {keys} keys; it must return one value per key, in order"
        )
    return values


def one_loader(name: str, fields: Fields, load_many: LoadMany) -> Callable[[], Awaitable[Any]]:
    """A single-key loader made of ``load_many`` (refreshes, handed-over keys)."""

    async def load() -> Any:
        return (await checked(name, load_many, [fields]))[0]

    return load
