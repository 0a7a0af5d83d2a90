"""Multi-key Redis operations of a batch (``get_many``, ``get_or_load_many``,
``set_many``): one round trip on a single node, one pipelined round trip per master in
a cluster (redis-py groups a cluster pipeline's commands by node and sends them
concurrently).

Every operation goes through ``L2Store.guard``: the shared breaker (a batch spans
nodes), the concurrency bound, and failures as ``L2Unavailable``. Scripts go as EVAL,
not EVALSHA: cluster pipelines refuse EVALSHA, and Redis caches the compiled script by
its SHA anyway.

A large batch goes in round trips of at most 1,000 keys (fills: also about 1 MB of
values), each under one ``redis.timeout`` (``_chunks`` says why).
"""

from __future__ import annotations

from collections.abc import Sequence

from layered_cache import _direct as direct
from layered_cache._chunks import by_count, by_size
from layered_cache._keys import fill_channel
from layered_cache._l2 import L2Store
from layered_cache._scripts import FILL_SCRIPT, RELEASE_SCRIPT, fill_args

__all__ = ["Fill", "L2Batch"]

Fill = tuple[str, str, bytes, int]  # (key, its lease, envelope bytes, ttl in ms)


def _fill_size(fill: Fill) -> int:
    return len(fill[2])


class L2Batch:
    def __init__(self, store: L2Store) -> None:
        self._store = store

    async def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The values of ``names`` in order (None: missing, or not a string)."""
        values: list[bytes | None] = []
        for chunk in by_count(names):
            values += await self._get_chunk(chunk)
        return values

    async def _get_chunk(self, names: Sequence[str]) -> list[bytes | None]:
        store = self._store
        if store.cluster:
            # Groups by slot, one pipelined MGET per slot: a round trip per master.
            operation = store.client.mget_nonatomic(list(names))  # type: ignore[union-attr]
        else:
            # Packed and parsed by ``_direct``, on a kept connection: redis-py's parser
            # awaits the stream once per value (50 of them on a list page), and its pool
            # checkout and ``wait_for`` cost as much again (``_direct``).
            assert store.direct is not None
            operation = direct.execute_command(store.direct, "MGET", *names)
        return list(await store.guard(operation))

    async def acquire_leases(self, leases: Sequence[str], token: str, ttl_ms: int) -> list[bool]:
        """SET NX PX every lease with one token: which ones we hold now. A failure may
        come after some chunks (or some commands of one) took theirs: the caller gives
        back every lease it asked for (a compare-and-delete by ``token``)."""
        held: list[bool] = []
        for chunk in by_count(leases):
            pipe = self._store.client.pipeline(transaction=False)
            for lease in chunk:
                pipe.set(lease, token, nx=True, px=ttl_ms)
            held += [bool(won) for won in await self._store.guard(pipe.execute())]
        return held

    async def fill_many(self, fills: Sequence[Fill], token: str) -> list[bool]:
        """Each key written only while ``token`` holds its lease (the FILL script, which
        also releases the lease and wakes the key's waiters): which ones were written."""
        written: list[bool] = []
        for chunk in by_size(fills, _fill_size):
            pipe = self._store.client.pipeline(transaction=False)
            for key, lease, data, ttl_ms in chunk:
                args = fill_args(token, data, ttl_ms, fill_channel(key), True, self._store.cluster)
                pipe.eval(FILL_SCRIPT, 2, key, lease, *args)
            written += [bool(done) for done in await self._store.guard(pipe.execute())]
        return written

    async def release_many(self, leases: Sequence[str], token: str) -> None:
        """Compare-and-delete each lease still holding ``token``."""
        for chunk in by_count(leases):
            pipe = self._store.client.pipeline(transaction=False)
            for lease in chunk:
                pipe.eval(RELEASE_SCRIPT, 1, lease, token)
            await self._store.guard(pipe.execute())
