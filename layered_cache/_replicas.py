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

**set()** writes base and replicas unconditionally, deleting the base lease with the
base write and then every replica lease (``set_plan``): a fill in flight, which may
carry an older value, loses its check or its replica writes. Replicas it doesn't
rewrite (the key is not hot here, maybe elsewhere) are deleted. In a cluster it runs in
two phases, as an invalidation: the base key and its lease first (one atomic step per
key), the replicas and their leases strictly afterwards (``write_many``).

**Counts must agree** across the fleet (``invalidation.check_replica_counts``): an
invalidator that knows fewer replicas than a writer leaves some behind.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence

from layered_cache._backplane import Announcement
from layered_cache._keys import fill_channel, lease_name, replica_names
from layered_cache._l2 import L2Store, L2Unavailable, Write
from layered_cache._scripts import WRITE_ONE_SCRIPT
from layered_cache._stampede import LeaseWaiter
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
    store: L2Store, writes: Sequence[Write], announcement: Announcement | None = None
) -> Append:
    """``set()``'s writes, each a ``set_plan`` with its value (``L2Store.write_many``).
    Returns what became of ``announcement`` (refused by the stream: the writes landed)."""
    if store.cluster and any(len(outdated) > 1 for _, outdated, _, _ in writes):
        # A cluster pipeline is not ordered across nodes, so in two phases, as an
        # invalidation: each base key written with its lease deleted, in one step per
        # key, before any replica or replica lease is touched. Only revoking the base
        # leases first (the base SET in phase 2) let a copy take a fresh lease, read the
        # *old* base while its node's SET was late, and write it to replicas whose
        # leases phase 2 had already deleted: replicas older than the base, served
        # after set() returned.
        await _write_bases(store, writes)
        writes = [(names[1:], outdated[1:], data, ttl) for names, outdated, data, ttl in writes]
    return await store.write_many(writes, announcement)


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
        await store.write_many([([lease for _, lease in replicas], (), token.encode(), reserve_ms)])
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
    ``token`` is the lease's, known to the caller: a cancelled copy's caller gives the
    lease back (``Refresher._copy``)."""
    try:
        if await leases.try_acquire(lease_name(key), lease_ttl, token) is None:
            return  # a fill or another copy holds the lease; it writes the replicas
        replicas = replica_leases(key, count)
        reserve = ([lease for _, lease in replicas], (), token.encode(), reserve_ms(lease_ttl))
        await store.write_many([reserve])
        # Read value + PTTL and release the lease in one atomic step: if the lease is
        # still ours, no invalidation has run phase 1 yet.
        current = await store.read_under_lease(key, lease_name(key), token)
    except L2Unavailable:
        # The lease may be ours (a late reply, a failed step after it): given back, or
        # every reader of the key would wait max_wait (the reservations expire with it).
        with contextlib.suppress(L2Unavailable):
            await store.release(lease_name(key), token)
        raise
    if current is not None and current[1] > 0:
        data, ttl_ms = current
        await store.fill_replicas(replicas, token, data, ttl_ms)


def reserve_ms(lease_ttl: float) -> int:
    """Reservations live as long as the lease they stand beside."""
    return max(1, int(lease_ttl * 1000))
