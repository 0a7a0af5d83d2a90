"""The facade: ``LayeredCache`` orchestrates L1, L2, the lease and the backplane.

It owns no storage logic (that lives in ``l1``, ``l2``, ``stampede``, ``backplane`` and
``invalidation``); it decides the order of steps on the read path:

    L1 -> single-flight -> L2 (random replica if hot) -> lease -> loader -> leased fill

and what happens when a step fails: a Redis failure falls through to the loader, a
loader failure falls back to a stale value within ``stale.max_age``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import random
import time
import typing
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ParamSpec, TypeVar

import structlog
from redis.asyncio.cluster import RedisCluster

from layered_cache.backplane import BackplaneListener, BackplanePublisher
from layered_cache.breaker import CircuitBreaker
from layered_cache.clients import (
    REDIS_FAILURES,
    RedisClient,
    make_client,
    make_node_client,
    with_timeout,
)
from layered_cache.codec import CodecError, Envelope
from layered_cache.config import Config
from layered_cache.hotreport import HotKeyReporter, report_key
from layered_cache.invalidation import Invalidator, ReplicaCountMismatch, check_replica_counts
from layered_cache.keys import lease_name, replica_name, replica_names
from layered_cache.l1 import MISSING
from layered_cache.l2 import L2Store, L2Unavailable
from layered_cache.notify import FillNotifier, fill_channel
from layered_cache.policy import Policy, compile_policy
from layered_cache.singleflight import SingleFlight
from layered_cache.stampede import LeaseWaiter
from layered_cache.xfetch import should_refresh_early

__all__ = ["LayeredCache"]

T = TypeVar("T")
P = ParamSpec("P")
Loader = Callable[[], Awaitable[Any]]

_log = structlog.get_logger("layered_cache")


class LayeredCache:
    """Async multi-layer cache. Use as ``async with LayeredCache.from_config(cfg) as c``."""

    def __init__(
        self,
        config: Config,
        *,
        value_types: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.config = config
        self._clock = clock
        self._rand = rand
        types = dict(value_types or {})
        unknown = set(types) - set(config.namespaces)
        if unknown:
            raise KeyError(f"value_types name unknown namespaces: {sorted(unknown)}")
        prefix = config.redis.prefix
        self._policies: dict[str, Policy] = {
            name: compile_policy(name, ns, prefix, types.get(name, Any))
            for name, ns in config.namespaces.items()
        }
        self.instance_id = os.urandom(6).hex()
        self.breaker = CircuitBreaker(config.redis.breaker.failures, config.redis.breaker.reset)
        self._client: RedisClient = make_client(config.redis)
        self.l2 = L2Store(self._client, self.breaker, config.redis.max_connections)
        self._notifier = FillNotifier(make_node_client(config.redis))
        self._leases = LeaseWaiter(self.l2, self._notifier)
        stream = prefix + config.backplane.stream
        publisher = (
            BackplanePublisher(self._client, stream, config.backplane.maxlen, self.instance_id)
            if config.backplane.enabled
            else None
        )
        self._invalidator = Invalidator(self.l2, publisher)
        self._listener_client: RedisClient | None = None
        self.backplane: BackplaneListener | None = None
        if config.backplane.enabled:
            # Blocking XREAD needs a socket timeout longer than the block time.
            listener_config = with_timeout(config.redis, config.backplane.block + 1.0)
            self._listener_client = make_client(listener_config)
            self.backplane = BackplaneListener(
                self._listener_client,
                stream,
                on_keys=self._drop_l1,
                on_gap=self._clear_l1,
                block=config.backplane.block,
                origin=self.instance_id,
            )
        self._flight: SingleFlight[Any] = SingleFlight()
        self._background: set[asyncio.Task[Any]] = set()
        self._refreshing: set[str] = set()
        # Instrumentation hooks (layered_cache.prometheus, layered_cache.tracing): called
        # on loads and L2 reads only, never on an L1 hit; empty/None costs nothing.
        self.load_observers: list[Callable[[str, float, bool], None]] = []
        self.l2_observers: list[Callable[[str, float], None]] = []
        self.load_wrapper: Callable[[str, Loader], Awaitable[Any]] | None = None
        detecting = any(p.hot is not None and p.hot.threshold for p in self._policies.values())
        self._hot_reporter = (
            HotKeyReporter(self._client, report_key(prefix, self.instance_id), self.hot_keys)
            if detecting
            else None
        )

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Config, **kwargs: Any) -> LayeredCache:
        return cls(config, **kwargs)

    async def __aenter__(self) -> LayeredCache:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start following the backplane (L1 coherence). A cluster client learns the
        slot map now rather than under the first burst of requests (if the cluster is
        unreachable it retries on first use; the cache works without it meanwhile)."""
        if isinstance(self._client, RedisCluster):
            with contextlib.suppress(*REDIS_FAILURES):
                await self._client.initialize()
        try:
            await self._check_replicas()
        except ReplicaCountMismatch:
            await self.close()
            raise
        if self.backplane is not None:
            self.backplane.start()
        if self._hot_reporter is not None:
            self._hot_reporter.start()

    async def _check_replicas(self) -> None:
        """Refuse to start with a hot.replicas other than the fleet's (see invalidation).
        Redis unreachable: start anyway (the cache works without Redis), unchecked."""
        counts = {name: policy.replicas for name, policy in self._policies.items() if policy.l2}
        try:
            await check_replica_counts(self._client, self.config.redis.prefix, counts)
        except REDIS_FAILURES as exc:
            _log.warning("replica_counts_unchecked", error=type(exc).__name__)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.backplane is not None:
            await self.backplane.stop()
        if self._hot_reporter is not None:
            await self._hot_reporter.stop()
        await self._notifier.close()
        for client in (self._client, self._listener_client):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()

    # -- public API --------------------------------------------------------------------

    def policy(self, namespace: str) -> Policy:
        try:
            return self._policies[namespace]
        except KeyError:
            raise KeyError(
                f"unknown namespace {namespace!r} (configured: {sorted(self._policies)})"
            ) from None

    def key(self, namespace: str, fields: Mapping[str, object]) -> str:
        """The full Redis key for these fields (validated)."""
        return self.policy(namespace).template.build(fields)

    def register_type(self, namespace: str, value_type: Any) -> None:
        """Declare the type L2 values of ``namespace`` decode into."""
        from layered_cache.codec import Codec

        self.policy(namespace).codec = Codec(value_type)

    async def get_or_load(
        self, namespace: str, fields: Mapping[str, object], loader: Loader
    ) -> Any:
        """The value from L1, else L2, else ``loader()`` (one load per key fleet-wide)."""
        policy = self._policies.get(namespace) or self.policy(namespace)
        key = policy.template.build(fields)
        if not policy.cache:
            policy.stats.miss += 1
            policy.stats.load += 1
            return await loader()
        l1 = policy.l1
        if l1 is not None:
            value = l1.get(key)
            if value is not MISSING:
                policy.stats.l1_hit += 1
                return value
        value, shared = await self._flight.do(key, lambda: self._fetch(policy, key, loader))
        if shared:
            policy.stats.coalesced += 1
        return value

    async def get(self, namespace: str, fields: Mapping[str, object]) -> Any:
        """The cached value or None; never loads. Stale values count as absent."""
        policy = self.policy(namespace)
        key = policy.template.build(fields)
        if not policy.cache:
            return None
        if policy.l1 is not None:
            value = policy.l1.get(key)
            if value is not MISSING:
                policy.stats.l1_hit += 1
                return value
        if not policy.l2:
            return None
        read_seq = policy.l1.begin_read() if policy.l1 is not None else 0
        try:
            envelope = await self._read_l2(policy, key)
        except L2Unavailable:
            policy.stats.redis_error += 1
            return None
        if envelope is None or self._clock() >= envelope.soft_expiry:
            return None
        policy.stats.l2_hit += 1
        self._fill_l1(policy, key, envelope.value, envelope.soft_expiry, read_seq)
        return envelope.value

    async def set(self, namespace: str, fields: Mapping[str, object], value: Any) -> None:
        """Write ``value`` to L2 (base and replicas) and this instance's L1; other
        instances drop their L1 copy through the backplane.

        Raises ``L2Unavailable`` if Redis fails, including when the value was written
        but the backplane append failed: then other instances may still serve their old
        L1 copy for its TTL, and returning normally would promise otherwise."""
        policy = self.policy(namespace)
        key = policy.template.build(fields)
        if not policy.cache:
            return
        policy.stats.set += 1
        self._flight.forget(key)
        read_seq: int | None = None
        if policy.l1 is not None:
            policy.l1.discard([key])
            # Like every other L1 fill: a remote set()/invalidate() of this key that
            # reaches us (backplane) while our write is in flight tombstones the key,
            # and then our value is superseded and must not sit in L1 for its TTL.
            read_seq = policy.l1.begin_read()
        if not policy.l2:
            self._fill_l1(policy, key, value, None, read_seq)
            return
        soft_expiry = self._clock() + policy.l2_ttl_draw()
        encoded = self._encode(policy, key, value, soft_expiry, 0.0)
        if encoded is None:
            return
        data, value = encoded
        names, outdated = self._set_names(policy, key)
        ttl_ms = self._redis_ttl_ms(policy, soft_expiry)
        if self.l2.cluster and len(outdated) > 1:
            # A cluster pipeline is not ordered across nodes: the base lease must be gone
            # before any replica lease is (see _set_names), so it goes first, alone.
            await self.l2.delete([outdated[0]])
        await self.l2.set_many(names, data, ttl_ms, delete_first=outdated)
        try:
            await self._invalidator.announce([key])
        except REDIS_FAILURES as exc:
            # L2 holds our value, but the other instances were not told to drop their L1
            # copies: set() must not return as if the write had reached everyone (like
            # invalidate(), it raises). Our own L1 is left empty: reads here go to L2.
            policy.stats.redis_error += 1
            self._flight.forget(key)
            if policy.l1 is not None:
                policy.l1.discard([key])
            raise L2Unavailable(
                f"set() wrote L2 but could not announce it on the backplane: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._settle_after_set(policy, key, value, soft_expiry, read_seq)

    def _settle_after_set(
        self, policy: Policy, key: str, value: Any, soft_expiry: float, read_seq: int | None
    ) -> None:
        """After our write landed: a load of this key that began while it was in flight
        may have read the value we replaced. Detach it (later callers must not join it)
        and tombstone the key again (its L1 fill is refused), then fill L1 with our value
        - unless a remote set()/invalidate() overtook ours meanwhile. No await in here:
        nothing can run between the checks and the fill."""
        self._flight.forget(key)
        l1 = policy.l1
        if l1 is None:
            return
        superseded = read_seq is not None and l1.invalidated_since(key, read_seq)
        l1.discard([key])
        if superseded:
            policy.stats.l1_fill_discarded += 1
            return
        self._fill_l1(policy, key, value, soft_expiry, l1.begin_read())

    def _set_names(self, policy: Policy, key: str) -> tuple[list[str], list[str]]:
        """(names ``set()`` writes, names it deletes first, in this order).

        Revoke any fill in flight (it may carry a value older than ours): the base lease
        first, then every replica's own lease. A hot fill reserves the replica leases
        before its base-lease check and writes each replica only while its reservation
        holds (see ``_fill``), so a fill that passed its check before our base-lease
        delete still loses every replica write that comes after our replica-lease
        delete - and one that came before is overwritten (or deleted) below. Replicas
        we don't rewrite (the key is not hot here, maybe elsewhere) are deleted.
        """
        names = [key]
        outdated = [lease_name(key)]
        if policy.hot is None or not policy.replicas:
            return names, outdated
        shards = replica_names(key, policy.replicas)
        outdated += [lease_name(shard) for shard in shards]
        if self._is_hot(policy, key):
            names += shards
        else:
            outdated += shards
        return names, outdated

    async def invalidate(self, namespace: str, fields: Mapping[str, object]) -> None:
        """Delete the L2 key, every replica and the lease; then drop L1 everywhere.

        Raises ``L2Unavailable`` if Redis can't be reached (the local L1 copy is dropped
        regardless).
        """
        policy = self.policy(namespace)
        key = policy.template.build(fields)
        await self.invalidate_keys([(policy, key)])

    async def invalidate_keys(self, targets: list[tuple[Policy, str]]) -> None:
        for policy, key in targets:
            policy.stats.invalidated += 1
            self._flight.forget(key)  # new callers must not join a pre-invalidation load
        self._drop_l1([key for _, key in targets])
        try:
            await self._invalidator.invalidate((key, p.replicas) for p, key in targets)
        except REDIS_FAILURES as exc:
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc
        # Drop again: a fill that read L2 before the delete may have landed meanwhile.
        self._drop_l1([key for _, key in targets])

    def cached(
        self, namespace: str, *, value_type: Any = None
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
        """Decorator: cache an async function; key fields come from its arguments.

        The return annotation (or ``value_type``) becomes the namespace's value type,
        so L2 hits decode into it.
        """
        self.policy(namespace)  # an unknown namespace fails here, not at the first call

        def decorate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
            signature = self.prepare_cached(namespace, fn, value_type)

            @functools.wraps(fn)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                result: T = await self.get_or_load(
                    namespace, bound.arguments, lambda: fn(*args, **kwargs)
                )
                return result

            return wrapper

        return decorate

    def prepare_cached(
        self, namespace: str, fn: Callable[..., Any], value_type: Any = None
    ) -> inspect.Signature:
        """Checks shared by the async and sync ``cached`` decorators: every key field is
        a parameter of ``fn``; its return annotation (or ``value_type``) becomes the
        namespace's value type. Returns the signature to bind calls with."""
        policy = self.policy(namespace)
        signature = inspect.signature(fn)
        missing = [f for f in policy.template.fields if f not in signature.parameters]
        if missing:
            raise KeyError(
                f"namespace {namespace!r}: {fn.__qualname__} has no parameter for key "
                f"field(s) {missing} of template {policy.template.template!r}"
            )
        declared = value_type
        if declared is None:
            declared = typing.get_type_hints(fn).get("return")
        if declared is not None and policy.codec.value_type is Any:
            self.register_type(namespace, declared)
        return signature

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters per namespace, plus ``_redis`` with the breaker state."""
        result: dict[str, dict[str, Any]] = {
            name: policy.stats.as_dict() for name, policy in self._policies.items()
        }
        result["_redis"] = {
            "breaker": self.breaker.state,
            "breaker_transitions": self.breaker.transitions,
            # Redis Cluster: one breaker per master (see L2Store.breaker_for).
            "node_breakers": {
                node: breaker.state for node, breaker in sorted(self.l2.node_breakers.items())
            },
        }
        return result

    def hot_keys(self) -> dict[str, dict[str, float]]:
        """Current hot keys per namespace with their measured L2 read rate (reads/s)."""
        return {
            name: policy.hot.hot_keys()
            for name, policy in self._policies.items()
            if policy.hot is not None
        }

    # -- read path ---------------------------------------------------------------------

    async def _fetch(self, policy: Policy, key: str, loader: Loader) -> Any:
        l1 = policy.l1
        read_seq = l1.begin_read() if l1 is not None else 0
        envelope: Envelope[Any] | None = None
        if policy.l2:
            try:
                envelope = await self._read_l2(policy, key)
            except L2Unavailable:
                policy.stats.redis_error += 1
                return await self._load_unleased(policy, key, loader, None)
        now = self._clock()
        if envelope is not None and now < envelope.soft_expiry:
            policy.stats.l2_hit += 1
            self._maybe_refresh_early(policy, key, envelope, loader, now)
            self._fill_l1(policy, key, envelope.value, envelope.soft_expiry, read_seq)
            return envelope.value
        policy.stats.miss += 1
        stale = envelope if self._within_stale(policy, envelope, now) else None
        if not policy.l2:
            value = await self._load_unleased(policy, key, loader, None)
            self._fill_l1(policy, key, value, None, read_seq)
            return value
        return await self._load_under_lease(policy, key, loader, stale, read_seq)

    async def _read_l2(self, policy: Policy, key: str) -> Envelope[Any] | None:
        # One coroutine, no wrapper: every await level costs a resumption per hop on
        # the L2-hit path, which is measured against a raw GET.
        observed = bool(self.l2_observers)
        started = time.perf_counter() if observed else 0.0
        data: bytes | None
        if policy.hot is not None and policy.replicas and policy.hot.record(key):
            index = self.l2.pick_replica(key, policy.replicas)  # balanced per master
            data = await self.l2.get(replica_name(key, index))
            if data is not None:
                policy.stats.replica_reads[index] += 1
            else:
                policy.stats.replica_miss += 1
                data = await self.l2.get(key)
                if data is not None:
                    self._spawn(self._populate_replicas(policy, key))
        else:
            data = await self.l2.get(key)
        if observed:
            elapsed = time.perf_counter() - started
            for observe in self.l2_observers:
                observe(policy.name, elapsed)
        return self._decode(policy, key, data)

    def _decode(self, policy: Policy, key: str, data: bytes | None) -> Envelope[Any] | None:
        if data is None:
            return None
        try:
            return policy.codec.decode(data)
        except CodecError as exc:
            # A foreign, truncated or old-format value: a miss. The next fill overwrites it.
            policy.stats.decode_error += 1
            _log.warning("l2_value_undecodable", namespace=policy.name, key=key, error=str(exc))
            return None

    def _recheck(self, policy: Policy, data: bytes | None) -> Envelope[Any] | None:
        """Decode a second read of the same key; undecodable bytes were already counted
        and logged by this request's first read, so they aren't again."""
        if data is None:
            return None
        try:
            return policy.codec.decode(data)
        except CodecError:
            return None

    def _fresh_data(self, policy: Policy, key: str) -> Callable[[bytes | None], bool]:
        def usable(data: bytes | None) -> bool:
            envelope = self._decode(policy, key, data)
            return envelope is not None and self._clock() < envelope.soft_expiry

        return usable

    async def _load_under_lease(
        self,
        policy: Policy,
        key: str,
        loader: Loader,
        stale: Envelope[Any] | None,
        read_seq: int,
    ) -> Any:
        lease = lease_name(key)
        try:
            token = await self._leases.try_acquire(lease, policy.lease_ttl)
            if token is None:
                policy.stats.lease_lost += 1
                result = await self._leases.wait_for_fill(
                    key,
                    lease,
                    policy.lease_ttl,
                    policy.retry,
                    policy.max_wait,
                    self._fresh_data(policy, key),
                )
                if result.data is not None:
                    envelope = self._decode(policy, key, result.data)
                    assert envelope is not None
                    policy.stats.lease_wait_filled += 1
                    self._fill_l1(policy, key, envelope.value, envelope.soft_expiry, read_seq)
                    return envelope.value
                if result.token is None:
                    # max_wait passed: load ourselves, but never write L2 without a lease.
                    policy.stats.lease_timeout_load += 1
                    return await self._load_unleased(policy, key, loader, stale, read_seq)
                token = result.token
            # Double-check under the lease: the previous winner's fill script releases
            # the lease as it writes, so a fill can land between our miss and our SET NX.
            # Loading now would be a second load for the same expiry.
            filled = self._recheck(policy, await self.l2.get(key))
            if filled is not None and self._clock() < filled.soft_expiry:
                await self._release_quietly(key, token)
                policy.stats.lease_wait_filled += 1
                self._fill_l1(policy, key, filled.value, filled.soft_expiry, read_seq)
                return filled.value
        except L2Unavailable:
            policy.stats.redis_error += 1
            return await self._load_unleased(policy, key, loader, stale, read_seq)
        policy.stats.lease_won += 1
        return await self._load_and_fill(policy, key, token, loader, stale, read_seq)

    async def _load_and_fill(
        self,
        policy: Policy,
        key: str,
        token: str,
        loader: Loader,
        stale: Envelope[Any] | None,
        read_seq: int | None,
    ) -> Any:
        started = time.monotonic()
        task: asyncio.Task[Any] = asyncio.ensure_future(self._call_loader(policy, loader))
        # The load runs on if our caller is cancelled (it holds the lease; shield below):
        # then nobody awaits it, and its failure must not surface as "Task exception was
        # never retrieved" (it is counted in load_error already).
        task.add_done_callback(_retrieve_outcome)
        try:
            if stale is not None and policy.load_timeout is not None:
                done, _ = await asyncio.wait({task}, timeout=policy.load_timeout)
                if not done and await self._stale_usable(policy, key, stale, read_seq):
                    # Slow loader and a stale value at hand: serve stale now, let the load
                    # finish in the background (still under the lease) and fill then.
                    policy.stats.stale_served += 1
                    _log.warning("load_timeout_serving_stale", namespace=policy.name, key=key)
                    self._spawn(self._finish_fill(policy, key, token, task, started, read_seq))
                    return stale.value
            value = await asyncio.shield(task)
        except Exception as exc:
            await self._release_quietly(key, token)
            return await self._stale_or_raise(policy, key, stale, exc, read_seq)
        return await self._fill(policy, key, token, value, time.monotonic() - started, read_seq)

    async def _finish_fill(
        self,
        policy: Policy,
        key: str,
        token: str,
        task: asyncio.Task[Any],
        started: float,
        read_seq: int | None,
    ) -> None:
        try:
            value = await task
        except Exception:
            await self._release_quietly(key, token)
            return
        # The request's read_seq, not None: an invalidation delivered while this slow
        # load ran (or between its L2 write and here) must keep it out of L1.
        await self._fill(policy, key, token, value, time.monotonic() - started, read_seq)

    async def _call_loader(self, policy: Policy, loader: Loader) -> Any:
        policy.stats.load += 1
        started = time.perf_counter()
        ok = False
        try:
            if self.load_wrapper is not None:
                value = await self.load_wrapper(policy.name, loader)
            else:
                value = await loader()
            ok = True
            return value
        except Exception:
            policy.stats.load_error += 1
            raise
        finally:
            for observe in self.load_observers:
                observe(policy.name, time.perf_counter() - started, ok)

    async def _load_unleased(
        self,
        policy: Policy,
        key: str,
        loader: Loader,
        stale: Envelope[Any] | None,
        read_seq: int | None = None,
    ) -> Any:
        """Load without writing L2 (no lease, or Redis unavailable)."""
        try:
            value = await self._call_loader(policy, loader)
        except Exception as exc:
            return await self._stale_or_raise(policy, key, stale, exc, read_seq)
        if not policy.l2:
            return value  # no L2 layer: the loader's object is what every layer returns
        encoded = self._encode(policy, key, value, 0.0, 0.0)
        return value if encoded is None else encoded[1]  # the type an L2 hit returns

    async def _stale_or_raise(
        self,
        policy: Policy,
        key: str,
        stale: Envelope[Any] | None,
        exc: Exception,
        read_seq: int | None,
    ) -> Any:
        if await self._stale_usable(policy, key, stale, read_seq):
            assert stale is not None
            policy.stats.stale_served += 1
            _log.warning(
                "loader_failed_serving_stale",
                namespace=policy.name,
                key=key,
                error=type(exc).__name__,
            )
            return stale.value
        raise exc

    async def _stale_usable(
        self, policy: Policy, key: str, stale: Envelope[Any] | None, read_seq: int | None
    ) -> bool:
        """Whether the fail-safe may serve ``stale``: within ``stale.max_age`` and not
        invalidated or overwritten since we read it. The load may have run for seconds,
        so "still the value in L2" is re-read (one GET, only on this fallback path): an
        invalidation deletes the key, a set() replaces it. The local tombstone catches an
        invalidation already delivered by the backplane without a round trip. If Redis
        can't confirm, don't serve: an invalidated value is never a fallback."""
        if stale is None or not self._within_stale(policy, stale, self._clock()):
            return False
        l1 = policy.l1
        if l1 is not None and read_seq is not None and l1.invalidated_since(key, read_seq):
            return False
        try:
            current = self._recheck(policy, await self.l2.get(key))
        except L2Unavailable:
            return False
        return (
            current is not None
            and current.written_at == stale.written_at
            and current.soft_expiry == stale.soft_expiry
        )

    def _within_stale(self, policy: Policy, envelope: Envelope[Any] | None, now: float) -> bool:
        return envelope is not None and now - envelope.soft_expiry <= policy.stale_max_age

    async def _fill(
        self,
        policy: Policy,
        key: str,
        token: str,
        value: Any,
        delta: float,
        read_seq: int | None,
    ) -> Any:
        """Write L2 under the lease (base, then replicas for a hot key), then L1.
        Returns the value as L2 readers will see it (see ``_encode``). Any error
        releases the lease: other readers must not wait max_wait for nothing."""
        try:
            return await self._fill_under_lease(policy, key, token, value, delta, read_seq)
        except Exception:
            await self._release_after_failed_fill(key, token)
            raise

    async def _fill_under_lease(
        self,
        policy: Policy,
        key: str,
        token: str,
        value: Any,
        delta: float,
        read_seq: int | None,
    ) -> Any:
        soft_expiry = self._clock() + policy.l2_ttl_draw()
        encoded = self._encode(policy, key, value, soft_expiry, delta)
        if encoded is None:
            await self._release_quietly(key, token)
            return value
        data, value = encoded
        ttl_ms = self._redis_ttl_ms(policy, soft_expiry)
        replicas = self._replica_leases(policy, key) if self._is_hot(policy, key) else []
        try:
            if replicas:
                # Reserve every replica under our token BEFORE the base key's lease check.
                reserve_ms = max(1, int(policy.lease_ttl * 1000))
                await self.l2.set_many([r for _, r in replicas], token.encode(), reserve_ms)
            written = await self.l2.fill(
                key, lease_name(key), token, data, ttl_ms, fill_channel(key), release=True
            )
            if written and replicas:
                # The check passed, so no invalidation's phase 1 (base + lease) had run
                # yet; its phase 2 comes later and deletes our reservations, so a replica
                # write landing after an invalidation fails, one landing before is deleted.
                await self.l2.fill_replicas(replicas, token, data, ttl_ms)
        except L2Unavailable:
            policy.stats.redis_error += 1
            await self._release_after_failed_fill(key, token)
            return value
        if not written:
            policy.stats.fill_revoked += 1
            return value
        self._fill_l1(policy, key, value, soft_expiry, read_seq)
        return value

    def _encode(
        self, policy: Policy, key: str, value: Any, soft_expiry: float, delta: float
    ) -> tuple[bytes, Any] | None:
        """(envelope bytes, the value decoded back from them), or None if not cacheable.

        Callers return and keep in L1 the decoded value, not the loader's object: a call
        must return the same type whichever layer answers it, and L2 hands out what the
        codec decodes (without a declared type: dict for a dataclass, str for a Decimal,
        UUID or date, list for a tuple or set). The decode happens once per fill or
        set(), never on a hit (cost measured in the README, "Use")."""
        try:
            data = policy.codec.encode(value, self._clock(), soft_expiry, delta)
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: ints > 64 bits
            policy.stats.not_cached += 1
            _log.warning("value_not_encodable", namespace=policy.name, key=key, error=str(exc))
            return None
        if len(data) > policy.max_value_bytes:
            policy.stats.not_cached += 1
            _log.warning(
                "value_too_large",
                namespace=policy.name,
                key=key,
                size=len(data),
                limit=policy.max_value_bytes,
            )
            return None
        try:
            return data, policy.codec.decode(data).value
        except CodecError as exc:  # encodable, but not as the declared type: L2 readers
            policy.stats.not_cached += 1  # would find it undecodable, so don't cache it
            _log.warning("value_not_decodable", namespace=policy.name, key=key, error=str(exc))
            return None

    def _redis_ttl_ms(self, policy: Policy, soft_expiry: float) -> int:
        """Hard expiry = soft expiry + the stale window the fail-safe may serve from."""
        return max(1, int((soft_expiry - self._clock() + policy.stale_max_age) * 1000))

    def _is_hot(self, policy: Policy, key: str) -> bool:
        return policy.hot is not None and policy.replicas > 0 and policy.hot.is_hot(key)

    def _fill_l1(
        self,
        policy: Policy,
        key: str,
        value: Any,
        soft_expiry: float | None,
        read_seq: int | None,
    ) -> None:
        l1 = policy.l1
        if l1 is None:
            return
        ttl = policy.l1_ttl_draw()
        if soft_expiry is not None:
            ttl = min(ttl, soft_expiry - self._clock())  # never outlive L2's freshness
        if not l1.put(key, value, ttl, read_seq) and ttl > 0:
            policy.stats.l1_fill_discarded += 1

    async def _release_after_failed_fill(self, key: str, token: str) -> None:
        """A fill that failed (Redis refused the write, a bug) must not keep its lease:
        every other reader would wait ``max_wait`` for a fill that never lands."""
        with contextlib.suppress(Exception):
            await self.l2.release(lease_name(key), token)

    async def _release_quietly(self, key: str, token: str) -> None:
        with contextlib.suppress(L2Unavailable):
            await self.l2.release(lease_name(key), token)

    # -- background work ---------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _maybe_refresh_early(
        self, policy: Policy, key: str, envelope: Envelope[Any], loader: Loader, now: float
    ) -> None:
        if policy.beta <= 0 or key in self._refreshing:
            return
        if not should_refresh_early(
            now, envelope.soft_expiry, envelope.delta, policy.beta, self._rand
        ):
            return
        self._refreshing.add(key)
        self._spawn(self._refresh(policy, key, envelope, loader))

    async def _refresh(
        self, policy: Policy, key: str, envelope: Envelope[Any], loader: Loader
    ) -> None:
        """XFetch refresh under the lease: one per key for the whole fleet."""
        try:
            token = await self._leases.try_acquire(lease_name(key), policy.lease_ttl)
            if token is None:
                return  # someone else is refreshing (or loading) it
            policy.stats.early_refresh += 1
            read_seq = policy.l1.begin_read() if policy.l1 is not None else None
            with contextlib.suppress(Exception):
                await self._load_and_fill(policy, key, token, loader, envelope, read_seq)
        except L2Unavailable:
            policy.stats.redis_error += 1
        finally:
            self._refreshing.discard(key)

    async def _populate_replicas(self, policy: Policy, key: str) -> None:
        """A newly hot key has no replicas yet: copy the base value with the same
        protocol as ``_fill`` (reserve replicas, then check the lease, then write under
        the reservations), so an invalidation racing the copy leaves no replica behind."""
        if key in self._refreshing:
            return
        self._refreshing.add(key)
        lease = lease_name(key)
        replicas = self._replica_leases(policy, key)
        try:
            token = await self._leases.try_acquire(lease, policy.lease_ttl)
            if token is None:
                return  # a fill or another copy holds the lease; it writes the replicas
            reserve_ms = max(1, int(policy.lease_ttl * 1000))
            await self.l2.set_many([r for _, r in replicas], token.encode(), reserve_ms)
            # Read value + PTTL and release the lease in one atomic step: if the lease
            # is still ours, no invalidation has run phase 1 yet (see invalidation.py).
            current = await self.l2.read_under_lease(key, lease, token)
            if current is not None and current[1] > 0:
                data, ttl_ms = current
                await self.l2.fill_replicas(replicas, token, data, ttl_ms)
        except L2Unavailable:
            policy.stats.redis_error += 1
        finally:
            self._refreshing.discard(key)

    @staticmethod
    def _replica_leases(policy: Policy, key: str) -> list[tuple[str, str]]:
        """(replica, its own lease ``{key#i}:lease``) pairs: each pair shares a slot."""
        return [(name, lease_name(name)) for name in replica_names(key, policy.replicas)]

    # -- backplane callbacks -----------------------------------------------------------

    def _drop_l1(self, keys: list[str]) -> None:
        """An invalidation (local, or from the backplane: the daemon or another
        instance): drop L1 and detach in-flight loads of the keys. A load that began
        before the invalidation may return the old value; callers arriving after it
        start a fresh load instead of joining that one. The old load's own fills are
        refused anyway (its lease is gone, its L1 read_seq is older than the tombstone)."""
        for key in keys:
            self._flight.forget(key)
        for policy in self._policies.values():
            if policy.l1 is not None:
                policy.l1.discard(keys)

    def _clear_l1(self) -> None:
        self._flight.forget_all()
        for policy in self._policies.values():
            if policy.l1 is not None:
                policy.l1.clear()


def _retrieve_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()

