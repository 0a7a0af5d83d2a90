"""Batches: ``get_many``, ``get_or_load_many`` and ``set_many`` of one namespace.

The point is round trips: a page of 50 books is one MGET (one pipelined round trip per
master in a cluster), its misses take their leases in one round trip, load in one
``load_many`` call and fill in one pipeline. The guarantees are the single-key ones:

- single-flight holds across batches and single calls: a key another caller is loading
  is joined, not loaded again (``SingleFlight.claim``);
- a key whose lease another process holds is handed to the single-key miss path, which
  waits for that fill (woken by pub/sub) exactly as a ``get_or_load`` would;
- fills write only under their lease, L1 only if no invalidation arrived since the read
  began, and a failed load falls back to a stale value only where ``MissPath`` allows;
  a load slower than ``load_timeout`` serves stale values as ``MissPath`` does, when
  every key it loads has one (``_batch_fill``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from layered_cache._batch_load import BatchLoader, Fields, LoadMany, all_or_none, one_loader
from layered_cache._batch_read import BatchReader
from layered_cache._failsafe import Read
from layered_cache._fills import Fills
from layered_cache._l2 import L2Unavailable
from layered_cache._l2batch import L2Batch
from layered_cache._miss import MissPath, TagsOf
from layered_cache._policy import Policy
from layered_cache._refresh import Refresher
from layered_cache._runtime import Runtime
from layered_cache._served import Served, served_of

__all__ = ["BatchPath", "LoadMany"]

GetOrLoad = Callable[[Fields, Callable[[], Awaitable[Any]], "TagsOf | None"], Awaitable[Any]]


class BatchPath:
    def __init__(
        self,
        policy: Policy,
        fills: Fills,
        miss: MissPath,
        refresher: Refresher,
        runtime: Runtime,
        get_or_load: GetOrLoad,
    ) -> None:
        self._policy = policy
        self._fills = fills
        self._rt = runtime
        batch = L2Batch(runtime.store)
        self._reader = BatchReader(policy, fills, refresher, runtime, batch)
        self._loader = BatchLoader(policy, fills, miss, refresher, runtime, self._reader, batch)
        self._get_or_load = get_or_load  # the single-key path, for keys handed over

    # -- get_many ----------------------------------------------------------------------

    async def get_many(self, fields_list: Sequence[Fields]) -> list[Any]:
        """Values in order, None for a miss; never loads."""
        policy = self._policy
        keys = [policy.template.build(fields) for fields in fields_list]
        if not policy.cache:
            return [None] * len(keys)
        found, missing = self._reader.from_l1(keys)
        if missing and policy.l2:
            self._rt.check_open()
            read_seq = policy.l1.begin_read() if policy.l1 is not None else None
            try:
                envelopes = await self._reader.read_many(missing, fresh_bases=True)
            except L2Unavailable:
                envelopes = {}
            if len(envelopes) < len(missing):  # Redis, or a cluster master, failed
                policy.stats.redis_error += 1
            now = self._rt.clock()
            for key, envelope in envelopes.items():
                if envelope is not None and now < envelope.soft_expiry:
                    policy.stats.l2_hit += 1
                    self._fills.fill_l1(
                        key, envelope.value, envelope.soft_expiry, read_seq, envelope.tags
                    )
                    found[key] = envelope.value
        return [found.get(key) for key in keys]

    async def get_or_load_many(
        self, fields_list: Sequence[Fields], load_many: LoadMany, tags: TagsOf | None = None
    ) -> list[Any]:
        """Values in order: L1, else L2, else one ``load_many(missing)`` call."""
        policy = self._policy
        fields_list = list(fields_list)  # read twice below: a generator would run dry
        keys = [policy.template.build(fields) for fields in fields_list]
        fields_of = dict(zip(keys, fields_list, strict=True))
        if not policy.cache:
            policy.stats.miss += len(fields_of)
            values = await self._loader.call(load_many, list(fields_of.values()))
            found = dict(zip(fields_of, values, strict=True))
            return [found[key] for key in keys]
        found, missing = self._reader.from_l1(keys)
        if missing:
            self._rt.check_open()
            found.update(await self._claimed(missing, fields_of, load_many, tags))
        return [found[key] for key in keys]

    async def _claimed(
        self,
        missing: list[str],
        fields_of: dict[str, Fields],
        load_many: LoadMany,
        tags: TagsOf | None,
    ) -> dict[str, Any]:
        """Load the keys nobody in this process is loading; join the others."""
        flight, policy = self._rt.flight, self._policy
        ours, theirs = flight.claim(missing)
        found: dict[str, Any] = {}
        if ours:
            seq, generation = policy.marks.begin_read(), self._fills.versions.generation
            reads = {key: Read(key, seq, None, tags, generation) for key in ours}

            def settle(values: dict[str, Any]) -> None:
                for key, value in values.items():
                    # A single read joining this flight takes what ``Namespace._serve``
                    # does. Settled twice (hits first, see ``fetch_many``): the first wins.
                    served = served_of(policy, self._fills.versions, reads[key], value)
                    flight.settle(key, ours[key], served)

            try:
                loaded = await self._loader.fetch_many(
                    reads, {key: fields_of[key] for key in ours}, load_many, settle
                )
            except BaseException as exc:
                flight.settle_all(ours, exc)
                raise
            settle(loaded)
            found.update(loaded)
        if theirs:
            self._policy.stats.coalesced += len(theirs)
            joins = [
                self._join(call, fields_of[key], load_many, tags) for key, call in theirs.items()
            ]
            # All or none: a join still running after another one raised would call
            # load_many for nobody once it fell back to the single-key path.
            found.update(zip(theirs, await all_or_none(joins), strict=True))
        return found

    async def _join(
        self, call: asyncio.Future[Any], fields: Fields, load_many: LoadMany, tags: TagsOf | None
    ) -> Any:
        try:
            served: Served = await asyncio.shield(call)
            return served.value
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not call.cancelled() or (task is not None and task.cancelling()):
                raise  # we are the ones being cancelled
        # The loading caller was cancelled, not us: this key goes the single-key way.
        loader = one_loader(self._policy.name, fields, load_many)
        return await self._get_or_load(fields, loader, tags)
