"""One namespace of the cache (a region, in dogpile.cache's terms): its policy, L1,
codec, stats and hot-key detector, and the read path that uses them, top-down:

    L1 -> single-flight -> L2 (this client's replica if hot) -> on a miss, ``miss.py``:
    lease -> loader -> leased fill (``replicas.py`` for hot keys)

A Redis failure falls through to the loader; a loader failure falls back to a stale
value within ``stale.max_age``. Storage is injected (``Runtime``): this module decides
the order of steps and owns no Redis command.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar, cast

from layered_cache._batch import BatchPath, LoadMany
from layered_cache._codec import Codec, Envelope, same_type
from layered_cache._fills import Fills
from layered_cache._keys import validate_tag
from layered_cache._l1 import MISSING
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache._miss import MissPath, Read, TagsOf, awaited
from layered_cache._policy import Policy
from layered_cache._refresh import Refresher
from layered_cache._runtime import Runtime
from layered_cache._served import Served, served_of
from layered_cache._tag_args import refuse_async_tags, tag_names
from layered_cache._writes import Writes

__all__ = ["Namespace", "check_tags"]

T = TypeVar("T")


class Namespace:
    """The cache of one namespace. Get it with ``cache.namespace("book")``."""

    def __init__(self, policy: Policy, runtime: Runtime) -> None:
        self.name = policy.name
        self.policy = policy
        self._rt = runtime
        self._fills = Fills(policy, runtime.clock, runtime.versions)
        self._miss = MissPath(policy, self._fills, runtime)
        self._refresher = Refresher(policy, self._fills, self._miss, runtime)
        self._miss.replicas_behind = self._refresher.copy_to_replicas
        self._writes = Writes(policy, self._fills, runtime, self._forget)
        self._batch = BatchPath(
            policy, self._fills, self._miss, self._refresher, runtime, self.get_or_load
        )
        self._type_declared_by = "value_types"
        self._served = partial(served_of, policy, self._fills.versions)  # what ``_fetch`` served
        # The L1-hit path of ``get``/``get_or_load``, resolved once (the policy's layers
        # don't change after startup): it is most requests' whole path, and each
        # attribute hop or call on it is a measurable share (bench/l1_hit.py).
        self._build = policy.template.build
        self._key_memo = policy.template.single_memo()
        self._stats = policy.stats
        l1 = policy.l1 if policy.cache else None
        self._l1_entries = l1.lock_free_entries() if l1 is not None else None

    def key(self, fields: Mapping[str, object]) -> str:
        """The full Redis key for these fields (validated)."""
        return self.policy.template.build(fields)

    def _declare_type(self, value_type: Any, *, by: str) -> None:
        """Reads of this namespace decode L2 values into ``value_type``. One type per
        namespace: a second, different declaration is an error, not silently ignored
        (whichever came first would otherwise decide what every read returns)."""
        if value_type is Any:
            return
        current = self.policy.codec.value_type
        if current is Any:
            self.policy.codec = Codec(value_type)
            self._type_declared_by = by
            if self.policy.l1 is not None:  # declared after reads: L1 holds (and fills
                self.policy.l1.clear()  # in flight carry) values of another type
        elif not same_type(current, value_type):
            raise TypeError(
                f"namespace {self.name!r} already decodes into {current!r} (declared by "
                f"{self._type_declared_by}); {by} declares {value_type!r}"
            )

    def stats(self) -> dict[str, int | dict[int, int]]:
        return self.policy.stats.as_dict()

    def hot_keys(self) -> dict[str, float]:
        """Current hot keys with their measured L2 read rate (reads/s)."""
        return self.policy.hot.hot_keys() if self.policy.hot is not None else {}

    # -- reads -------------------------------------------------------------------------

    async def get_or_load(
        self,
        fields: Mapping[str, object],
        loader: Callable[[], Awaitable[T]],
        tags: TagsOf | None = None,
    ) -> T:
        """The value from L1, else L2, else ``loader()`` (one load per key fleet-wide).
        ``tags``: the loaded value's tags, a list or a function of the value."""
        key = self._build(fields)
        entries = self._l1_entries
        if entries is not None and tags is None:
            # The L1 hit, inlined (``L1Cache.get`` says why no lock); an expired or absent
            # entry raises KeyError. No tombstone check: an invalidation deletes the entry.
            try:
                value = entries[key]
            except KeyError:
                pass
            else:
                self._stats.l1_hit += 1
                return value  # type: ignore[no-any-return]
        return await self._get_or_load(key, loader, tags)

    async def _get_or_load(
        self, key: str, loader: Callable[[], Awaitable[T]], tags: TagsOf | None
    ) -> T:
        return (await self._serve(key, loader, tags)).value  # type: ignore[no-any-return]

    async def _serve(
        self, key: str, loader: Callable[[], Awaitable[Any]], tags: TagsOf | None = None
    ) -> Served:
        """``get_or_load`` of ``key`` (``self.key(fields)``), saying what it served."""
        policy = self.policy
        check_tags(policy, tags)
        if not policy.cache:
            policy.stats.miss += 1
            policy.stats.load += 1
            return Served(await awaited(policy.name, loader), owned=True)
        l1 = policy.l1
        if l1 is not None:
            value = l1.get(key)
            if value is not MISSING:
                policy.stats.l1_hit += 1
                return Served(value)
        self._rt.check_open()
        served: Served
        served, shared = await self._rt.flight.do(key, lambda: self._fetch(key, loader, tags))
        if shared:
            policy.stats.coalesced += 1
        return served

    async def get(self, fields: Mapping[str, object]) -> Any:
        """The cached value or None; never loads. Stale values count as absent."""
        key = self._build(fields)
        entries = self._l1_entries
        if entries is not None:  # the L1 hit, inlined as in get_or_load
            try:
                value = entries[key]
            except KeyError:
                pass
            else:
                self._stats.l1_hit += 1
                return value
        return await self._get(key)

    async def _get(self, key: str) -> Any:
        policy = self.policy
        if not policy.cache:
            return None
        if policy.l1 is not None:
            value = policy.l1.get(key)
            if value is not MISSING:
                policy.stats.l1_hit += 1
                return value
        if not policy.l2:
            return None
        self._rt.check_open()
        read_seq = policy.l1.begin_read() if policy.l1 is not None else None
        try:
            envelope, from_replica = await self._read_l2(key)
        except L2Unavailable:
            policy.stats.redis_error += 1
            return None
        if envelope is None or self._rt.clock() >= envelope.soft_expiry:
            # A hot key's replica answered, unusable: the base may hold a fresh value.
            envelope = await self._refresher.fresh_base(key) if from_replica else None
            if envelope is None:
                return None
        policy.stats.l2_hit += 1
        self._fills.fill_l1(key, envelope.value, envelope.soft_expiry, read_seq, envelope.tags)
        return envelope.value

    async def _fetch(
        self, key: str, loader: Callable[[], Awaitable[Any]], tags: TagsOf | None
    ) -> Served:
        policy = self.policy
        read = Read(key, policy.marks.begin_read(), None, tags, self._fills.versions.generation)
        envelope: Envelope[Any] | None = None
        if policy.l2:
            try:
                async with self._rt.admission:  # see Runtime.admission
                    envelope, _ = await self._read_l2(key)
            except L2Unavailable:  # the loader answers this read: a miss, as docs/metrics.md
                policy.stats.redis_error += 1
                policy.stats.miss += 1
                return self._served(read, await self._miss.load_unleased(read, loader))
        now = self._rt.clock()
        if envelope is not None and now < envelope.soft_expiry:
            policy.stats.l2_hit += 1
            self._refresher.maybe_refresh_early(read, envelope, loader, now)
            self._fills.fill_l1(key, envelope.value, envelope.soft_expiry, read.seq, envelope.tags)
            return self._served(read, envelope.value)
        policy.stats.miss += 1
        if not policy.l2:
            return self._served(read, await self._miss.load_l1_only(read, loader))
        read.stale = envelope if self._fills.within_stale(envelope, now) else None
        return self._served(read, await self._miss.load_under_lease(read, loader))

    async def _read_l2(self, key: str) -> tuple[Envelope[Any] | None, bool]:
        """The envelope (None: absent, undecodable, or dead), and whether a hot key's
        replica answered (``Refresher.fresh_base``)."""
        # One coroutine, no wrapper: every await level costs a resumption per hop on
        # the L2-hit path, which is measured against a raw GET.
        policy, store = self.policy, self._rt.store
        observers = self._rt.hooks.l2_observers
        started = time.perf_counter() if observers else 0.0
        data: bytes | None
        from_replica = False
        if policy.hot is not None and policy.replicas and policy.hot.record(key):
            data, from_replica = await _read_replica(store, policy, self._refresher, key)
        else:
            data = await store.get(key)
        if observers:
            elapsed = time.perf_counter() - started
            for observe in observers:
                observe(policy.name, elapsed)
        envelope = self._fills.decode(key, data)
        tags = envelope.tags if envelope is not None else None
        if tags is not None and not await self._fills.versions.valid(tags):
            return None, from_replica  # a tag of it was invalidated: dead, not even stale
        return envelope, from_replica

    # -- writes ------------------------------------------------------------------------

    async def set(
        self, fields: Mapping[str, object], value: Any, tags: Iterable[str] | None = None
    ) -> None:
        """Write ``value`` to L2 (base and replicas) and this instance's L1; other
        instances drop their L1 copy through the backplane. Raises ``L2Unavailable``
        if Redis fails (see ``_writes``)."""
        check_tags(self.policy, tags)  # a string is refused there (``_tag_args``)
        await self._writes.set_many([(fields, value)], tags)

    async def set_many(self, items: Sequence[tuple[Mapping[str, object], Any]]) -> None:
        """``set`` for many keys: one pipelined round trip, one backplane append."""
        await self._writes.set_many(items)

    # -- batches (``_batch``) -------------------------------------------------------------

    async def get_many(self, fields_list: Sequence[Mapping[str, object]]) -> list[Any]:
        """Values in order, None for a miss; L1, then one MGET; never loads."""
        return await self._batch.get_many(fields_list)

    async def get_or_load_many(
        self,
        fields_list: Sequence[Mapping[str, object]],
        load_many: LoadMany,
        tags: TagsOf | None = None,
    ) -> list[Any]:
        """Values in order: L1, else L2 (one MGET), else one ``load_many(missing)``
        call that returns one value per missing key, in order."""
        check_tags(self.policy, tags)
        return await self._batch.get_or_load_many(fields_list, load_many, tags)

    def _forget_tag(self, tag: str) -> int:
        """Drop from L1 every entry filled with ``tag``; how many were there. Also
        without ``tags = true`` (an old pod of a deploy turning tags on indexes what it
        reads). With it, every load of this namespace in flight is detached too: its
        tags are known only once it returns, and later callers must not join it."""
        if self.policy.tags:
            template, flight = self.policy.template, self._rt.flight
            for key in flight.running():
                if template.owns(key):
                    flight.forget(key)
        return self._forget(self._fills.forget_tag(tag))

    def _forget(self, keys: list[str]) -> int:
        """Drop ``keys`` from L1 (without L1, tombstone them: ``Policy.marks``) and detach
        their loads in flight: one that began before an invalidation may return the old
        value, and callers arriving after it load afresh. Its own fills are refused (no
        lease, a read_seq older than the tombstone), what it serves is superseded."""
        for key in keys:
            self._rt.flight.forget(key)
        return self.policy.marks.discard(keys)


def check_tags(policy: Policy, tags: object) -> list[str]:
    """Tags given to a namespace that takes none, a list no entry may carry (a string,
    bytes, a bad name, too many) or an async tags function are refused before anything
    runs, whichever layer would answer (the sync API checks before its L1 hit too).
    Returns the list's tags, each once (none for a function of the value: what it
    returns is checked once there is a value, ``tag_names``)."""
    if tags is None:
        return []
    if not policy.tags:
        raise ValueError(
            f"namespace {policy.name!r} takes no tags: declare tags = true in its config"
        )
    if callable(tags):
        refuse_async_tags(tags)
        return []
    if isinstance(tags, Iterator):
        # Read here, it would be empty where the entry is written: an untagged entry
        # that no invalidate_tag kills.
        raise TypeError(
            "tags must be a list, a tuple or a function of the value, not a one-shot "
            f"iterator ({type(tags).__name__}): it would be read once"
        )
    names = tag_names(cast(Iterable[str], tags), None)
    for tag in names:
        validate_tag(tag)
    return names


async def _read_replica(
    store: L2Store, policy: Policy, refresher: Refresher, key: str
) -> tuple[bytes | None, bool]:
    """A hot key's L2 read: this client's current replica (``ReplicaPlacement.pick``:
    balanced per master, sticky per client), else the base key. A replica that fails or
    is missing makes the client move on to the next master; a missing one is copied from
    the base key in the background; a failed one, in a cluster, is read from the base
    key (on another master, maybe healthy). Outside ``Namespace._read_l2`` only for the class's
    size limit: one more await level on a hot read is ~0.5 us of a ~200 us GET."""
    placement = store.placement
    index, name = placement.pick(key, policy.replicas)
    try:
        data = await store.get(name)
    except L2Unavailable:
        placement.move_on(key)  # this master failed us: the next read tries another
        if not store.cluster:
            raise  # one node: the base key is on the one that just failed
        # The base key may be on a healthy master: read it rather than send the hottest
        # key of all to the loader each time the rotation reaches the dead one.
        return await store.get(key), False
    if data is not None:
        policy.stats.replica_reads[index] += 1
        return data, True
    policy.stats.replica_miss += 1
    placement.move_on(key)
    data = await store.get(key)
    if data is not None:
        refresher.copy_to_replicas(key)
    return data, False
