"""The load half of ``get_or_load_many``: the keys this call claimed are read in one
MGET; the misses take their leases in one round trip; the won keys load in one
``load_many`` call and fill in one pipeline; the lost keys go to the single-key miss
path, which waits for the holder's fill as a ``get_or_load`` would."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

from layered_cache._batch_read import BatchReader
from layered_cache._codec import Envelope
from layered_cache._failsafe import Misshapen
from layered_cache._fills import Fills
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable
from layered_cache._l2batch import Fill, L2Batch
from layered_cache._loading import Loading
from layered_cache._miss import MissPath, Read, awaited, call_loader
from layered_cache._policy import Policy
from layered_cache._refresh import Refresher
from layered_cache._runtime import Runtime
from layered_cache._stampede import new_token
from layered_cache._tags import tag_names

__all__ = ["BatchLoader", "Fields", "LoadMany", "checked", "one_loader", "versions_of"]

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
        self._loading = Loading(runtime.store, runtime.prefix, runtime.tasks.spawn)

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
        policy, first = self._policy, next(iter(reads.values()))
        seq, tags = first.seq, first.tags_of
        if not policy.l2:
            policy.stats.miss += len(reads)
            generation = self._fills.versions.generation
            values = await self.call(load_many, list(fields_of.values()))
            loaded = [(key, seq, value) for key, value in zip(fields_of, values, strict=True)]
            await self._fills.fill_l1_only(loaded, tags, generation)
            return dict(zip(fields_of, values, strict=True))
        try:
            envelopes = await self._reader.read_many(list(fields_of))
        except L2Unavailable:
            policy.stats.redis_error += 1
            return await self._load_unleased(list(reads.values()), fields_of, load_many)
        found: dict[str, Any] = {}
        now = self._rt.clock()
        for key, envelope in envelopes.items():
            if envelope is not None and now < envelope.soft_expiry:
                policy.stats.l2_hit += 1
                loader = one_loader(self._policy.name, fields_of[key], load_many)
                self._refresher.maybe_refresh_early(reads[key], envelope, loader, now)
                self._fills.fill_l1(key, envelope.value, envelope.soft_expiry, seq, envelope.tags)
                found[key] = envelope.value
            else:
                policy.stats.miss += 1
                reads[key].stale = envelope if self._fills.within_stale(envelope, now) else None
        misses = [read for key, read in reads.items() if key not in found]
        if misses:
            on_hits(found)
            found.update(await self._load_misses(misses, fields_of, load_many))
        return found

    async def _load_misses(
        self, reads: list[Read], fields_of: dict[str, Fields], load_many: LoadMany
    ) -> dict[str, Any]:
        """Take every miss's lease in one round trip; load the won keys in one call and
        hand the lost ones to the single-key path (it waits for the holder's fill)."""
        policy = self._policy
        token = new_token()
        ttl_ms = max(1, int(policy.lease_ttl * 1000))
        try:
            held = await self._batch.acquire_leases(
                [lease_name(r.key) for r in reads], token, ttl_ms
            )
        except L2Unavailable:
            policy.stats.redis_error += 1
            self._give_back(reads, token)  # some SET NXs may have landed: see _l2batch
            return await self._load_unleased(reads, fields_of, load_many)
        except asyncio.CancelledError:
            self._give_back(reads, token)  # the SET NXs may have landed before the cancel
            raise
        won = [read for read, ours in zip(reads, held, strict=True) if ours]
        lost = [read for read, ours in zip(reads, held, strict=True) if not ours]
        policy.stats.lease_lost += len(lost)
        waits = [self._get_or_load_lost(r, fields_of[r.key], load_many) for r in lost]
        try:
            results = await all_or_none([self._load_won(won, fields_of, load_many, token), *waits])
        except BaseException:
            # The lost keys' waits give back their own (``MissPath.load_under_lease``).
            self._give_back(won, token)
            raise
        found: dict[str, Any] = results[0]
        found.update(zip((r.key for r in lost), results[1:], strict=True))
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
        found = await self._filled_meanwhile(reads, token)
        todo = [read for read in reads if read.key not in found]
        if not todo:
            return found
        self._policy.stats.lease_won += len(todo)
        leases = [lease_name(r.key) for r in todo]
        if self._policy.tags:
            try:  # before the load: see ``_tags``
                await self._loading.enter(leases, token)
            except L2Unavailable:
                self._policy.stats.redis_error += 1
                await self._release([r.key for r in todo], token)
                found.update(await self._load_unleased(todo, fields_of, load_many))
                return found
        started = time.monotonic()
        try:
            values = await self.call(load_many, [fields_of[r.key] for r in todo])
        except asyncio.CancelledError:
            raise  # the batch's caller gives every won lease back (``_get_or_load``)
        except BaseException as exc:  # as ``MissPath.load_and_fill``
            await self._release([r.key for r in todo], token)
            if not isinstance(exc, Exception):
                raise  # not an error to serve stale for (GreenletExit, an app's abort)
            found.update(await self._miss.failsafe.serve_all_or_raise(todo, exc))
            return found
        else:
            # Each entry's recompute time for XFetch (with 0 none was refreshed early).
            delta = time.monotonic() - started
            try:
                found.update(await self._fill_many(todo, values, token, delta))
            except Exception:
                # Not Redis (``_fill_many`` handles that): a tag function that raised or
                # a bad tag. The leases go back, as ``MissPath.fill`` does, or every
                # reader of these keys would wait ``max_wait`` for fills that never land.
                await self._release([r.key for r in todo], token)
                raise
        finally:
            if self._policy.tags:
                self._loading.leave(leases, token)
        return found

    async def _filled_meanwhile(self, reads: list[Read], token: str) -> dict[str, Any]:
        """Fills that landed between our MGET and our SET NX (``MissPath._filled_meanwhile``)."""
        try:
            data = await self._batch.get_many([r.key for r in reads])
        except L2Unavailable:
            return {}
        now = self._rt.clock()
        filled: list[tuple[Read, Envelope[Any]]] = []
        for read, value in zip(reads, data, strict=True):
            envelope = self._fills.recheck(value)
            if envelope is not None and now < envelope.soft_expiry:
                filled.append((read, envelope))
        # A tagged copy counts only if its tags are current, judged as the MGET judged
        # it (``BatchReader._alive``): the copy found here may be the very one the MGET
        # refused as dead, not a fill that landed since.
        tagged = [(read, envelope) for read, envelope in filled if envelope.tags is not None]
        try:
            verdicts = await self._fills.versions.valid_many([e.tags or {} for _, e in tagged])
        except L2Unavailable:
            verdicts = [False] * len(tagged)
        dead = {read.key for (read, _), valid in zip(tagged, verdicts, strict=True) if not valid}
        found: dict[str, Any] = {}
        for read, envelope in filled:
            if read.key in dead:
                continue
            self._policy.stats.lease_wait_filled += 1
            self._fills.fill_l1(
                read.key, envelope.value, envelope.soft_expiry, read.seq, envelope.tags
            )
            found[read.key] = envelope.value
        await self._release(list(found), token)
        return found

    async def _fill_many(
        self, reads: list[Read], values: Sequence[Any], token: str, delta: float
    ) -> dict[str, Any]:
        """Each value under its lease, in one pipeline (hot keys: ``_replicas``); L1 then."""
        policy, fills = self._policy, self._fills
        found: dict[str, Any] = {}
        batch: list[tuple[Read, Fill, Any, float, dict[str, str] | None]] = []
        hot: list[tuple[Read, Any]] = []
        uncacheable: list[str] = []  # not encodable or too large: served, not stored
        try:
            versions = await versions_of(self._fills, reads, values)
        except L2Unavailable:  # no version, no fill: the values are served, not stored
            policy.stats.redis_error += 1
            await self._release([r.key for r in reads], token)
            return {r.key: self._miss.as_read(r, v) for r, v in zip(reads, values, strict=True)}
        for read, value, tagged in zip(reads, values, versions, strict=True):
            if fills.is_hot(read.key):
                hot.append((read, value))
                continue
            soft_expiry = policy.soft_expiry(value, self._rt.clock())
            encoded = fills.encode(read.key, value, soft_expiry, delta, tagged)
            found[read.key] = encoded.value
            read.owned = encoded.value is value  # not encodable: handed back as it came
            if encoded.data is None:
                uncacheable.append(read.key)
                continue
            data = encoded.data
            fill = (read.key, lease_name(read.key), data, fills.redis_ttl_ms(soft_expiry))
            batch.append((read, fill, found[read.key], soft_expiry, tagged))
        await self._release(uncacheable, token)
        try:
            written = await self._batch.fill_many([b[1] for b in batch], token)
        except L2Unavailable:
            policy.stats.redis_error += 1
            await self._release([b[1][0] for b in batch], token)
            written = [False] * len(batch)
        for (read, _, value, soft_expiry, tagged), done in zip(batch, written, strict=True):
            if done:
                fills.fill_l1(read.key, value, soft_expiry, read.seq, tagged)
            else:
                policy.stats.fill_revoked += 1
                read.revoked = True  # served, but no gateway may keep it (``Served``)
        # Hot keys fill one by one through the replica protocol (reserve, check, write
        # replicas): rare, and each spans several slots.
        filled = await asyncio.gather(*(self._miss.fill(r, token, v, delta) for r, v in hot))
        found.update((read.key, result) for (read, _), result in zip(hot, filled, strict=True))
        return found

    async def _load_unleased(
        self, reads: list[Read], fields_of: dict[str, Fields], load_many: LoadMany
    ) -> dict[str, Any]:
        """Load without writing L2 (Redis unavailable): the type an L2 hit would give."""
        try:
            values = await self.call(load_many, [fields_of[r.key] for r in reads])
        except Exception as exc:
            return await self._miss.failsafe.serve_all_or_raise(reads, exc)
        return {r.key: self._miss.as_read(r, v) for r, v in zip(reads, values, strict=True)}

    def _give_back(self, reads: list[Read], token: str) -> None:
        """``_release`` in the background, for a cancelled batch (``MissPath.give_back``)."""
        if reads:
            self._rt.tasks.spawn(self._release([r.key for r in reads], token))

    async def _release(self, keys: list[str], token: str) -> None:
        # Redis down: the leases expire by themselves (lease_ttl).
        with contextlib.suppress(L2Unavailable):
            await self._batch.release_many([lease_name(key) for key in keys], token)

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


async def versions_of(
    fills: Fills, reads: list[Read], values: Sequence[Any]
) -> list[dict[str, str] | None]:
    """Each loaded value's ``{tag: version}`` (versions of all of them fetched in one
    round trip), or None per value when the batch has no tags."""
    tags_of = reads[0].tags_of if reads else None
    if tags_of is None:
        return [None] * len(reads)
    names = [tag_names(tags_of, value) for value in values]
    current = await fills.versions.current(t for tags in names for t in tags)
    return [{tag: current[tag] for tag in tags} for tags in names]
