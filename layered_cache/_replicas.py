"""The hot-key replica protocol: how replicas are filled, copied, overwritten and
deleted so that none outlives an invalidation. Explained here once; ``l2.py`` has the
Redis commands, ``invalidation.py`` and ``namespace.py`` call these steps.

A hot key ``book:42`` has replicas ``book:42#0..#N-1`` (reads pick one at random) and
every replica has its own lease ``{book:42#i}:lease``. Replicas hash to other slots than
the base key, so in a cluster no Lua script can check the base key's lease and write a
replica in one step. The protocol instead orders steps across slots:

1. **Reserve.** A fill (or a copy) first SETs every replica lease to its own token.
2. **Check.** It then writes the base key with the compare-and-write script: only while
   its token still holds ``{book:42}:lease`` (and the script releases that lease).
3. **Write replicas.** If the check passed, it writes each replica with the same
   script against that replica's own lease (its reservation).

**Invalidation** deletes in two phases (``delete_phases``): phase 1 the base key and its
lease, phase 2, strictly afterwards, every replica with its lease. A fill whose check
(step 2) passed did so before phase 1, so its reservations (step 1, earlier still) exist
when phase 2 runs: phase 2 deletes them and any replica already written, and a replica
write landing after phase 2 finds its reservation gone and fails. On a single node both
phases are one atomic DEL.

**set()** writes base and replicas unconditionally on a single node, in one atomic
step that deletes the base lease and every replica lease (``set_plan``): a fill in
flight, which may carry an older value, loses its check or its replica writes.
Replicas it doesn't rewrite (the key is not hot here, maybe elsewhere) are deleted.

**set() in a cluster** can't be one step; it runs in phases (``write_many``), each
acknowledged by every node before the next is sent:

0. **Reserve** (a hot key only): every replica lease SET to the set's own token
   (``set:...``). A fill's or a copy's reservation is taken over (its replica writes
   fail); a later fill or copy can't take this one back (``RESERVE_SCRIPT``).
1. **Base**: each base key written with its lease deleted, one atomic step per key. A
   fill whose check comes later fails; a copy reads the new base or nothing.
2. **Replicas**: each written only while the set's reservation still holds its lease
   (``SET_RESERVED_SCRIPT``), else deleted; replicas not rewritten are deleted with
   their leases, as an invalidation's phase 2.

An invalidation that runs between the phases deletes the reservations with the
replicas, so phase 2 writes nothing: the result is the invalidation's (everything
gone), or the new base with replicas missing until a read copies the base back, never
replicas outliving their base. Written unconditionally, as they were, the replicas
kept the set's value for the L2 TTL after the invalidation had deleted the base key.

A step that fails once phase 0 was sent may leave bases new and replicas old (a master
that stalled during phase 2): the caller drops the keys everywhere, as an invalidation
(``_writes``, ``WriteEnds.drop_later``), not only announces them.

**Counts must agree** across the fleet (``invalidation.check_replica_counts``): an
invalidator that knows fewer replicas than a writer leaves some behind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

from layered_cache._backplane import Announcement
from layered_cache._chunks import by_size
from layered_cache._keys import fill_channel, lease_name, replica_names
from layered_cache._l2 import L2Store, Write
from layered_cache._scripts import (
    RESERVE_SCRIPT,
    SET_RESERVATION,
    SET_RESERVED_SCRIPT,
    WRITE_ONE_SCRIPT,
)
from layered_cache._stampede import LeaseWaiter, new_token
from layered_cache._write_commands import Append

__all__ = [
    "copy_to_replicas",
    "delete_name_phases",
    "delete_phases",
    "fill",
    "replica_leases",
    "set_plan",
    "write_many",
]


def replica_leases(key: str, count: int) -> list[tuple[str, str]]:
    """(replica, its own lease ``{key#i}:lease``) pairs: each pair shares a slot."""
    return [(name, lease_name(name)) for name in replica_names(key, count)]


def delete_phases(key: str, count: int) -> tuple[list[str], list[str]]:
    """Invalidation's (phase 1: base key and lease, phase 2: replicas and their leases)."""
    shards = replica_names(key, count)
    return [key, lease_name(key)], [name for shard in shards for name in (shard, lease_name(shard))]


def delete_name_phases(
    targets: Iterable[tuple[str, int]],
) -> tuple[list[str], list[bytes], list[bytes]]:
    """``delete_phases`` of many ``(key, replica count)`` at once: (the keys, phase 1,
    phase 2), the names as UTF-8 bytes (what redis-py sends for a str).

    The daemon deletes 18 names per event (8 replicas): built as str through
    ``lease_name`` / ``replica_names``, then encoded again by redis-py on every send,
    they cost half as much as the DEL itself (bench/daemon_floor.py). Here each key is
    encoded once and its names are one ``bytes.join`` (the key between pieces computed
    once per replica count, ``_joined``), NUL-separated; one ``split`` per batch makes
    them names. No valid key holds a NUL (``_keys``); if one ever did, the count of
    names would be off, and they are built one by one instead. Within a phase the
    order of names given does not matter (``L2Store.delete`` sends the leases first);
    between phases it does, and is kept."""
    targets = list(targets)  # a generator too: the fallback reads them again
    keys: list[str] = []
    bases: list[bytes] = []
    replicas: list[bytes] = []
    expected = 0
    base_pieces = _joined(0)
    for key, count in targets:
        keys.append(key)
        name = key.encode()
        bases.append(name.join(base_pieces))
        if count:
            replicas.append(name.join(_joined(count)))
            expected += 2 * count
    phase1 = _SEPARATOR.join(bases).split(_SEPARATOR) if bases else []
    phase2 = _SEPARATOR.join(replicas).split(_SEPARATOR) if replicas else []
    if len(phase1) != 2 * len(keys) or len(phase2) != expected:
        return _names_one_by_one(targets)
    return keys, phase1, phase2


_SEPARATOR = b"\0"
_KEY_MARK = "\x01"  # stands for the key while the pieces are computed


@functools.cache
def _joined(count: int) -> tuple[bytes, ...]:
    """``key.join(_joined(n))`` = a key's names NUL-separated: with n = 0 its phase 1
    (the key, its lease), else its phase 2 (each of n replicas, then that replica's
    lease), built from ``lease_name`` and ``replica_names`` themselves."""
    if count:
        names = [n for shard in replica_names(_KEY_MARK, count) for n in (shard, lease_name(shard))]
    else:
        names = [_KEY_MARK, lease_name(_KEY_MARK)]
    text = _SEPARATOR.decode().join(names)
    return tuple(piece.encode() for piece in text.split(_KEY_MARK))


def _names_one_by_one(
    targets: list[tuple[str, int]],
) -> tuple[list[str], list[bytes], list[bytes]]:
    phase1: list[bytes] = []
    phase2: list[bytes] = []
    for key, count in targets:
        bases, replicas = delete_phases(key, count)
        phase1 += [name.encode() for name in bases]
        phase2 += [name.encode() for name in replicas]
    return [key for key, _ in targets], phase1, phase2


def set_plan(key: str, count: int, hot: bool) -> tuple[list[str], list[str]]:
    """(names ``set()`` writes, names it deletes first, in this order): the base lease
    first, then every replica lease; then the replicas themselves unless the key is hot
    here (then they are rewritten)."""
    names = [key]
    outdated = [lease_name(key)]
    if not count:
        return names, outdated
    shards = replica_names(key, count)
    outdated += [lease_name(shard) for shard in shards]
    if hot:
        names += shards
    else:
        outdated += shards
    return names, outdated


async def write_many(
    store: L2Store,
    writes: Sequence[Write],
    announcement: Announcement | None,
    lease_ttl: float,
    phased: Callable[[], object] | None = None,
) -> Append:
    """``set()``'s writes, each a ``set_plan`` with its value (``L2Store.write_many``).
    Returns what became of ``announcement`` (refused by the stream: the writes landed).
    ``lease_ttl`` (seconds): how long a cluster set()'s reservations live, at least.
    ``phased``: called as the phases of a cluster set() of hot keys begin (from then
    on a failure may leave replicas older than the base: the caller drops the keys)."""
    if store.cluster and any(len(outdated) > 1 for _, outdated, _, _ in writes):
        # A cluster pipeline is not ordered across nodes: in phases (the module doc).
        # Only revoking the base leases first (the base SET with the replicas) let a
        # copy take a fresh lease, read the *old* base while its node's SET was late,
        # and write it to replicas whose leases were already deleted.
        hot = [write for write in writes if len(write[0]) > 1]
        token = SET_RESERVATION + new_token()  # no fill's or copy's: ``RESERVE_SCRIPT``
        if hot:
            if phased is not None:
                phased()
            leases = [lease for _, outdated, _, _ in hot for lease in outdated[1:]]
            reservation = (leases, (), token.encode(), _set_reserve_ms(store, lease_ttl))
            await store.write_many([reservation])  # plain SETs: a fill's are taken over
        await _write_bases(store, writes)
        await _write_reserved(store, hot, token)
        writes = [(names[1:], outdated[1:], data, ttl) for names, outdated, data, ttl in writes]
        writes = [write for write in writes if not write[0]]  # not hot here: deleted
    return await store.write_many(writes, announcement)


def _set_reserve_ms(store: L2Store, lease_ttl: float) -> int:
    """A set()'s reservations must outlive phases 1 and 2: one that expired first lets
    a fill reserve again, and its replica write (under a check passed before phase 1,
    maybe an older value) land where phase 2 then fails. The lease TTL, as a fill's,
    and at least three ``redis.timeout`` (each phase bounded by one)."""
    return max(reserve_ms(lease_ttl), 3 * reserve_ms(store.deadline or 0.0))


async def _write_reserved(store: L2Store, writes: Sequence[Write], token: str) -> None:
    """Phase 2 of a cluster set() of hot keys: each replica written only while ``token``
    still holds its lease (``SET_RESERVED_SCRIPT``), in pipelines (EVAL: cluster
    pipelines refuse EVALSHA) of about ``CHUNK_BYTES`` each."""
    replicas = [
        (name, lease, data, ttl_ms)
        for names, outdated, data, ttl_ms in writes
        for name, lease in zip(names[1:], outdated[1:], strict=True)
    ]
    for chunk in by_size(replicas, lambda replica: len(replica[2])):
        pipe = store.client.pipeline(transaction=False)
        for name, lease, data, ttl_ms in chunk:
            pipe.eval(SET_RESERVED_SCRIPT, 2, name, lease, token, data, ttl_ms)
        await store.guard(pipe.execute(), names=[name for name, _, _, _ in chunk])


async def _write_bases(store: L2Store, writes: Sequence[Write]) -> None:
    """Phase 1 of a cluster set(): SET each base key and DEL its lease, atomically per
    key (``WRITE_ONE_SCRIPT``: one slot), in one pipeline (EVAL: cluster pipelines
    refuse EVALSHA)."""
    pipe = store.client.pipeline(transaction=False)
    for names, outdated, data, ttl_ms in writes:
        pipe.eval(WRITE_ONE_SCRIPT, 2, names[0], outdated[0], data, ttl_ms)
    await store.guard(pipe.execute())


async def fill(
    store: L2Store,
    key: str,
    token: str,
    data: bytes,
    ttl_ms: int,
    replicas: list[tuple[str, str]],
    reserve_ms: int,
) -> bool:
    """A leased fill: reserve ``replicas`` (empty when the key is not hot), check-and-write
    the base key (releasing the lease, waking waiters), then write the replicas under
    their reservations. Returns whether the base write happened (False: revoked)."""
    if replicas:
        await _reserve(store, [lease for _, lease in replicas], token, reserve_ms)
    written = await store.fill(
        key, lease_name(key), token, data, ttl_ms, fill_channel(key, store.db), release=True
    )
    if written and replicas:
        await store.fill_replicas(replicas, token, data, ttl_ms)
    return written


async def copy_to_replicas(
    store: L2Store, leases: LeaseWaiter, key: str, count: int, lease_ttl: float, token: str
) -> None:
    """A newly hot key has no replicas yet: copy the base value under the same protocol
    (reserve, check, write), so an invalidation racing the copy leaves no replica.
    ``token`` is the lease's, known to the caller: a copy cancelled or failed (its
    lease may be ours) has its caller give the lease back (``Refresher._copy``)."""
    if await leases.try_acquire(lease_name(key), lease_ttl, token) is None:
        return  # a fill or another copy holds the lease; it writes the replicas
    replicas = replica_leases(key, count)
    await _reserve(store, [lease for _, lease in replicas], token, reserve_ms(lease_ttl))
    # Read value + PTTL and release the lease in one atomic step: if the lease is
    # still ours, no invalidation has run phase 1 yet.
    current = await store.read_under_lease(key, lease_name(key), token)
    if current is not None and current[1] > 0:
        data, ttl_ms = current
        await store.fill_replicas(replicas, token, data, ttl_ms)


def reserve_ms(lease_ttl: float) -> int:
    """Reservations live as long as the lease they stand beside."""
    return max(1, int(lease_ttl * 1000))


async def _reserve(store: L2Store, leases: list[str], token: str, ttl_ms: int) -> None:
    """A fill's or a copy's reservations (step 1). On a single node plain SETs in one
    transaction: a set() there is one atomic step and reserves nothing. In a cluster
    one ``RESERVE_SCRIPT`` per lease: a set()'s reservation is left to it."""
    if not store.cluster:
        await store.write_many([(leases, (), token.encode(), ttl_ms)])
        return
    pipe = store.client.pipeline(transaction=False)
    for lease in leases:
        pipe.eval(RESERVE_SCRIPT, 1, lease, token, ttl_ms)
    await store.guard(pipe.execute(), names=leases)
