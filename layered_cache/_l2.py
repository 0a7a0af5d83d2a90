"""L2: the shared Redis layer (single node or Redis Cluster).

Owns every Redis command of the read/fill path and nothing else: reads, leased fills,
unconditional sets, lease acquire/release and multi-key deletes. Each call goes through
the circuit breaker; any Redis failure (error, timeout, breaker open) surfaces as
``L2Unavailable`` so the facade has one thing to catch and can fall through to the
loader.

The Lua scripts and why each must be one atomic step are in ``_scripts``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ClusterError, ResponseError

from layered_cache import _direct as direct
from layered_cache._breaker import CircuitBreaker
from layered_cache._chunks import by_size
from layered_cache._clients import (
    REDIS_FAILURES,
    RedisClient,
    raised_in_redis_py,
    resurface_cancel,
)
from layered_cache._logs import error_text
from layered_cache._nodebreakers import NodeBreakers
from layered_cache._placement import ReplicaPlacement
from layered_cache._replyerrors import is_key_error
from layered_cache._scripts import (
    FILL_SCRIPT,
    NOTIFY_INLINE_MAX,
    READ_UNDER_LEASE_SCRIPT,
    RELEASE_SCRIPT,
    WRITE_ONE_SCRIPT,
    fill_args,
)
from layered_cache._topology import RefreshingCluster
from layered_cache._write_commands import (
    Append,
    Write,
    one_write_args,
    run_transaction,
    script_append,
)

if TYPE_CHECKING:
    from layered_cache._backplane import Announcement

__all__ = [
    "NOTIFY_INLINE_MAX", "BreakerOpen", "L2Store", "L2Unavailable", "LeaseRefused", "Write",
]

_log = structlog.get_logger("layered_cache.l2")


T = TypeVar("T")


def _write_size(write: Write) -> int:
    return len(write[2]) * len(write[0])  # the value, once per name it is written to


def _leases_first(names: Sequence[str | bytes]) -> list[str | bytes]:
    """``names`` with the leases (``{key}:lease``: no key holds a brace) first, in order.
    Not one DEL of a key with its lease: while their slot migrates, Redis refuses a
    command on names of the slot split between two masters (TRYAGAIN), which a key
    without a lease (nearly all) is, so invalidations of the slot failed for the whole
    migration. Apart, the lease goes first: a fill in flight checks it, so it can't land
    an old value once the key is gone (a key deleted first could be refilled so)."""
    leases = [name for name in names if name[:1] in (b"{", "{")]
    if not leases:
        return list(names)
    return leases + [name for name in names if name[:1] not in (b"{", "{")]


async def _within(operation: Awaitable[T], seconds: float) -> T:
    async with asyncio.timeout(seconds):
        return await operation


def _get(store: L2Store, name: str) -> Awaitable[bytes | None]:
    """GET, packed by ``_direct`` on a single node: redis-py's per-send ``wait_for``
    costs a Task and three event-loop iterations per command (``_direct``),
    60-90 µs of CPU on the bench VM against ~170 µs for the whole GET without it. A
    cluster routes through redis-py (MOVED/ASK, the slot map)."""
    if store.cluster:
        return store.client.get(name)  # type: ignore[return-value]  # bytes: decode_responses is off
    assert store.direct is not None
    return direct.execute_command(store.direct, "GET", name, reply_cap=store.reply_cap)


def _set_nx(store: L2Store, name: str, value: str, ttl_ms: int) -> Awaitable[Any]:
    """SET NX PX, packed by ``_direct`` on a single node (why: ``_get``)."""
    if store.cluster:
        return store.client.set(name, value, nx=True, px=ttl_ms)
    assert store.direct is not None
    return direct.execute_command(store.direct, "SET", name, value, "NX", "PX", ttl_ms)


def _script(
    store: L2Store, script: AsyncScript, keys: list[str], args: list[bytes | str | int]
) -> Awaitable[Any]:
    """One of our scripts: an EVALSHA packed by ``_direct`` on a single node (why:
    ``_get``; NOSCRIPT loads it on the same connections), redis-py's script object in a
    cluster."""
    if store.cluster:
        return script(keys=keys, args=args)
    assert store.direct is not None
    return direct.evalsha(store.direct, script, keys, args)


class L2Unavailable(Exception):
    """Redis could not be used for this operation (error, timeout or breaker open)."""


class BreakerOpen(L2Unavailable):
    """Refused by the circuit breaker before anything was sent: nothing of it can land
    later (a write that timed out may: ``_unsettled``), and no lease to give back
    (``GiveBacks``)."""


class LeaseRefused(BreakerOpen):
    """A ``SET NX`` the open breaker refused: no lease was asked for, none to give back."""


def _direct_client(client: RedisClient, busy_poll: float) -> direct.DirectClient | None:
    return None if isinstance(client, RedisCluster) else direct.DirectClient(client, busy_poll)


def _database(client: RedisClient) -> int:
    """The database number ``client`` selects (a cluster has only 0)."""
    if isinstance(client, RedisCluster):
        return 0
    return int(client.connection_pool.connection_kwargs.get("db") or 0)


class L2Store:
    """Redis operations of the cache, each guarded by the circuit breaker."""

    def __init__(
        self,
        client: RedisClient,
        breaker: CircuitBreaker,
        max_in_flight: int = 64,
        deadline: float | None = None,
        busy_poll: float = 0.0,  # seconds (``_busypoll``); single node only
        reply_cap: int = 0,  # bytes a single-key GET may read; single node only (``get``)
    ) -> None:
        self.client = client
        self.breaker = breaker
        # Bounds the read path's connections: a burst queues here (no timer), not one each.
        self.slots, self.max_in_flight = asyncio.Semaphore(max_in_flight), max_in_flight
        self.breakers = NodeBreakers(client, breaker)
        self.node_breakers = self.breakers.by_node  # one per master (cluster), by host:port
        self.key_errors = 0  # per-key error replies (WRONGTYPE, ...): not node failures
        self.cluster = isinstance(client, RedisCluster)
        self.db = _database(client)  # fill channels carry it (``_keys.fill_channel``)
        # Single node: the request path's commands, on connections kept between them.
        self.direct = _direct_client(client, busy_poll)
        self.reply_cap, self.notify_inline_max = reply_cap, NOTIFY_INLINE_MAX
        self._fill = client.register_script(FILL_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._read_under_lease = client.register_script(READ_UNDER_LEASE_SCRIPT)
        self._write_one = client.register_script(WRITE_ONE_SCRIPT)
        self.placement = ReplicaPlacement(client)
        # Cluster only: one overall deadline per operation (``bounded``). A single node's
        # socket timeout bounds each command already and nothing retries behind it.
        self.deadline = deadline if self.cluster else None
        if isinstance(client, RefreshingCluster):
            client.refresh_listeners.append(self.breakers.drop_gone)
            # redis-py flags its map as stale after a failed single command, not after a
            # failed pipeline (without retries nothing else would ever refresh it: the
            # daemon's deletes would go to a dead master forever).
            breaker.on_failure = client.refresh_soon

    def bounded(self, operation: Awaitable[T]) -> Awaitable[T]:
        """``operation`` cut off at ``deadline`` (TimeoutError: a failure of the node's
        breaker). Socket timeouts bound one command; in a cluster one operation may be
        several (MOVED/ASK, a connect, a pipeline per node), and a failover must not
        stretch a request past the configured timeout. ``asyncio.timeout``, not
        ``wait_for``: on Python 3.11 ``wait_for`` can swallow the caller's own
        cancellation. Not before the first slot map is known: the discovery itself
        (CLUSTER SLOTS, COMMAND) is one-off and may need longer on a busy machine."""
        if self.deadline is None or not self.client.nodes_manager.slots_cache:  # type: ignore[union-attr]
            return operation
        return _within(operation, self.deadline)

    async def guard(
        self, operation: Any, name: str | None = None, names: Sequence[str | bytes] = ()
    ) -> Any:
        """Run ``operation`` under the breaker of the node holding ``name`` (or all of
        ``names``, else the shared one) and the concurrency bound (``L2Unavailable``)."""
        breaker = self.breakers.for_names(names) if names else self.breakers.for_name(name)
        if not breaker.allow():
            operation.close()
            raise BreakerOpen("circuit breaker open")
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        try:
            async with self.slots:
                if breaker.opened():  # opened while we queued: ``CircuitBreaker.opened``
                    operation.close()
                    raise BreakerOpen("circuit breaker open")
                result = await self.bounded(operation)
        except REDIS_FAILURES as exc:
            if is_key_error(exc):
                breaker.success()  # the node answered: not a node failure
                self.key_errors += 1
            else:
                breaker.failure(exc)
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
        except AttributeError as exc:
            if not raised_in_redis_py(exc):
                breaker.abandon()
                raise  # our bug, not Redis: it must surface
            breaker.failure(exc)
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            breaker.abandon()  # cancelled: a probe must not stay in flight forever
            raise
        breaker.success()  # Redis answered, even if our caller was cancelled meanwhile
        resurface_cancel(task, requested)
        return result

    async def get(self, name: str) -> bytes | None:
        # _guard inlined: this is the L2-hit path, where one more coroutine level is a
        # measurable share of a loopback GET.
        breaker = self.breakers.for_name(name)
        if not breaker.allow():
            raise BreakerOpen("circuit breaker open")
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        try:
            async with self.slots:
                if breaker.opened():  # opened while we queued: ``CircuitBreaker.opened``
                    raise BreakerOpen("circuit breaker open")
                result = await self.bounded(_get(self, name))
        except (ResponseError, ClusterError, direct.ReplyTooLarge) as exc:
            if not is_key_error(exc):
                breaker.failure(exc)
                raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
            # WRONGTYPE & co, a foreign value over ``reply_cap``, a slot in migration:
            # this key is unusable for now, the node is fine. A miss: the next fill's SET
            # overwrites it, repairing it.
            breaker.success()
            self.key_errors += 1
            _log.warning("l2_key_error", key=name, error=error_text(exc))
            return None
        except REDIS_FAILURES as exc:
            breaker.failure(exc)
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
        except AttributeError as exc:
            if not raised_in_redis_py(exc):
                breaker.abandon()
                raise  # our bug, not Redis: it must surface
            breaker.failure(exc)
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            # Cancelled (client timeout/disconnect). Free: try/except costs nothing
            # until something is raised (zero-cost exceptions, CPython 3.11+).
            breaker.abandon()
            raise
        breaker.success()
        resurface_cancel(task, requested)
        return result

    async def acquire_lease(self, lease: str, token: str, ttl_ms: int) -> bool:
        """SET NX PX: the first caller gets the lease; it expires by itself if we crash."""
        return bool(await self.guard(_set_nx(self, lease, token, ttl_ms), lease))

    async def fill(
        self,
        key: str,
        lease: str,
        token: str,
        data: bytes,
        ttl_ms: int,
        channel: str,
        release: bool,
    ) -> bool:
        """Write ``key`` only while ``token`` holds ``lease`` (see FILL_SCRIPT)."""
        inline_max = self.notify_inline_max
        args = fill_args(token, data, ttl_ms, channel, release, self.cluster, inline_max)
        return bool(await self.guard(_script(self, self._fill, [key, lease], args), key))

    async def release(self, lease: str, token: str) -> bool:
        """Compare-and-delete; False means the lease was revoked or taken over."""
        return bool(await self.guard(_script(self, self._release, [lease], [token]), lease))

    async def write_many(
        self, writes: Sequence[Write], announcement: Announcement | None = None
    ) -> Append:
        """Each ``(names, delete_first, data, ttl_ms)``: SET ``names`` to ``data`` and DEL
        ``delete_first`` (the leases the write revokes), then append ``announcement``
        (set()'s backplane entry; single node only). Returns what became of the append
        (refused by the stream: the writes landed); raises if the writes failed.

        On a single node it is one atomic step, a script or a MULTI/EXEC
        (``_write_commands`` says which, why atomic, and why the SETs come first). In a
        cluster it is a pipeline that redis-py splits per node; commands to one node
        keep their order, so the DEL of a key's lease (same slot as the key) runs before
        the SET of the key. A cluster can't make names of several slots atomic: there the
        replicas of concurrent writers may disagree until their TTL (docs/hotkeys.md)."""
        if not writes:
            return Append.DONE
        if not self.cluster:
            assert self.direct is not None
            if (one := one_write_args(writes, announcement)) is not None:
                script = direct.evalsha(self.direct, self._write_one, *one)  # not hot: a script
                return script_append(await self.guard(script))
            appended: Append = await self.guard(run_transaction(self.direct, writes, announcement))
            return appended
        assert announcement is None, "a cluster announces after the writes"
        for chunk in by_size(writes, _write_size):  # not atomic anyway: see ``_chunks``
            pipe = self.client.pipeline(transaction=False)
            for names, delete_first, data, ttl_ms in chunk:
                for name in delete_first:
                    pipe.delete(name)  # single-key DELs: never one command across slots
                for name in names:
                    pipe.set(name, data, px=ttl_ms)
            await self.guard(pipe.execute(), names=[n for w in chunk for n in (*w[0], *w[1])])
        return Append.DONE

    async def delete(self, names: Sequence[str | bytes]) -> int:
        """Delete names in one round trip per node. In a cluster one DEL per name, the
        cluster pipeline grouping them per node (retrying on MOVED/ASK as redis-py
        allows), leases first (``_leases_first``)."""
        if not names:
            return 0
        if not self.cluster:
            assert self.direct is not None
            return int(await self.guard(direct.execute_command(self.direct, "DEL", *names)))
        pipe = self.client.pipeline(transaction=False)
        for name in _leases_first(names):
            pipe.delete(name)
        results = await self.guard(pipe.execute(), names=names)
        return sum(int(result) for result in results)

    async def delete_in_order(self, groups: Sequence[Sequence[str | bytes]]) -> int:
        """Delete ``groups`` one after another: every name of a group is gone from every
        node before any name of the next group is deleted.

        A cluster pipeline is not atomic across nodes, so ordering needs separate round
        trips; on a single node one DEL of all names is atomic, which orders them
        trivially (nothing runs in between) at the cost of one round trip.
        """
        if not self.cluster:
            names: list[str | bytes] = []
            for group in groups:
                names += group  # one C-level copy per group, not a loop per name
            return await self.delete(names)
        deleted = 0
        for group in groups:
            deleted += await self.delete(group)
        return deleted

    async def fill_replicas(
        self, replicas: Sequence[tuple[str, str]], token: str, data: bytes, ttl_ms: int
    ) -> int:
        """Write each ``(replica, replica_lease)`` only while ``token`` holds that
        replica's own lease, deleting the lease in the same script. Returns how many
        replicas were written.

        Replicas hash to different slots, so no single script can check the base key's
        lease and write them all; each replica is guarded by ``{key#i}:lease`` in its own
        slot instead (``_replicas.py`` explains why that is enough). Cluster
        pipelines refuse EVALSHA, so the script goes as EVAL: a hot fill is rare and
        Redis caches the compiled script by its SHA anyway.
        """
        if not replicas:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for name, lease in replicas:
            pipe.eval(FILL_SCRIPT, 2, name, lease, token, data, ttl_ms, "", "1")
        results = await self.guard(pipe.execute())
        return sum(int(result) for result in results)

    async def read_under_lease(self, key: str, lease: str, token: str) -> tuple[bytes, int] | None:
        """``(value, pttl_ms)`` of ``key`` if ``token`` still held ``lease`` (which this
        releases), else None. Both names share a slot: one atomic script."""
        script = self._read_under_lease
        result = await self.guard(_script(self, script, [key, lease], [token]), key)
        if not result:
            return None
        data, pttl = result
        return bytes(data), int(pttl)
