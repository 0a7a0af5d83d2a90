"""What ``LayeredCache.start`` does before serving, each bounded so that a cache starts
(and works, falling back to the loader) even when Redis is down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from typing import Any

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

from layered_cache._backplane import BackplaneListener
from layered_cache._clients import REDIS_FAILURES, RedisClient
from layered_cache._coherence import Coherence
from layered_cache._config import Config, RedisConfig
from layered_cache._fallback import FallbackSubscriber, fallback_channel, subscribed
from layered_cache._hotreport import HotKeyReporter
from layered_cache._invalidation import Invalidator, check_replica_counts, recorded_counts
from layered_cache._keys import hot_report_name
from layered_cache._logs import error_text
from layered_cache._memory_policy import log_memory_policies, tagged_namespaces
from layered_cache._namespace import Namespace
from layered_cache._purges import Purger, purges_for
from layered_cache._redisclock import RedisClock
from layered_cache._runtime import Runtime
from layered_cache._stampede import LeaseWaiter
from layered_cache._tags import TagVersions, version_ttl
from layered_cache._wiring import CacheParts, new_instance_id

__all__ = [
    "OneAtATime",
    "background_checks",
    "check_database",
    "check_memory_policy",
    "check_replicas",
    "check_transactions",
    "first_steps",
    "followers",
    "forked",
    "hot_key_reporter",
    "learn_slots",
    "listening",
    "positioned",
    "positioned_now",
    "reopened",
    "runtime",
    "start_wait",
    "started_elsewhere",
    "unplaced",
]

_log = structlog.get_logger("layered_cache")


async def learn_slots(client: RedisClient, within: float) -> float:
    """A cluster client learns the slot map now rather than under the first burst of
    requests (if the cluster is unreachable it retries on first use). Within the
    start's one wait: returns what is left of ``within``, for ``first_steps``
    (unbounded, a hung or unreachable seed cost redis-py's own timeouts and retries on
    top of that wait)."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + within
    if isinstance(client, RedisCluster):
        with contextlib.suppress(*REDIS_FAILURES, TimeoutError):
            await asyncio.wait_for(client.initialize(), within)
    return ends - loop.time()


def start_wait(redis: RedisConfig) -> float:
    """How long a start waits for a Redis that is down (README): 1.2 s by default."""
    return 2 * (redis.connect_timeout + redis.timeout)


async def first_steps(
    clock: RedisClock,
    client: RedisClient,
    namespaces: Iterable[Namespace],
    followers: tuple[BackplaneListener | None, FallbackSubscriber | None],
    config: Config,
    within: float,
) -> None:
    """Start the ``followers`` (the backplane off: none), then wait for the clock's first
    samples (before any read or write stamps an envelope), the replica-count check
    (before any serving) and the listener's position together, each ``within`` seconds
    (what ``learn_slots`` left of ``start_wait``). One after the other, against a
    Redis that is down each paid its own timeout (a hung one: one ``redis.timeout``
    each; an unreachable one: one ``connect_timeout`` each) on top of the listener's
    wait. A mismatch raises at once,
    the other steps cancelled (``close()`` follows: it stops the followers)."""
    seconds, prefix = max(0.0, within), config.redis.prefix
    steps = [clock.start(seconds), check_replicas(client, prefix, namespaces, seconds)]
    listener, fallback = followers
    if listener is not None and fallback is not None:
        listener.start()
        fallback.start()
        steps.append(listening(listener, fallback, seconds))
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # ended before close() stops what they start
        raise


async def check_replicas(
    client: RedisClient, prefix: str, namespaces: Iterable[Namespace], within: float | None = None
) -> None:
    """Refuse to start with a hot.replicas other than the fleet's (``_invalidation``):
    raises ``ReplicaCountMismatch``. Redis unreachable (or not done ``within`` seconds):
    start anyway, unchecked."""
    counts = recorded_counts(ns.policy for ns in namespaces)
    try:
        async with asyncio.timeout(within):
            await check_replica_counts(client, prefix, counts)
    except REDIS_FAILURES as exc:
        _log.warning("replica_counts_unchecked", error=type(exc).__name__)


async def positioned(listener: BackplaneListener, seconds: float) -> None:
    """Wait (``seconds`` at most) until the backplane listener knows its position in the
    stream: before that, an invalidation announced right after a first L1 fill would be
    missed, and the fill served for its L1 TTL (every forked worker, whose cache starts
    on its first request, opened that window)."""
    try:
        await asyncio.wait_for(listener.connected.wait(), seconds)
    except TimeoutError:
        listener.late()  # serving anyway: L1 is cleared once the position is known


def unplaced(listener: BackplaneListener | None) -> bool:
    """Whether the listener has yet to take its place (a first start, or one after
    close()): a place taken, not a live connection (one may drop a moment later)."""
    return listener is not None and listener.last_id is None


def positioned_now(unplaced: bool, listener: BackplaneListener | None, l1s: Coherence) -> None:
    """Once this start placed the listener (``unplaced`` before it): drop L1. What calls
    before the start (a warm-up on its loop) or beside it put there had no listener
    following the stream: what was announced meanwhile falls before the position."""
    if unplaced and listener is not None:
        if listener.last_id is None:  # no place yet (a dropped connection): when it has one
            listener.late()
        else:
            l1s.forget_all()


def background_checks(client: RedisClient, config: Config) -> list[Coroutine[Any, Any, Any]]:
    """The start's checks that only log (each a line with its fix): run in the
    background, not worth delaying the start on a slow Redis."""
    redis = config.redis
    return [
        check_memory_policy(client, redis, tagged_namespaces(config)),
        check_transactions(client, redis),
        check_database(client, redis),
    ]


async def check_memory_policy(
    client: RedisClient, redis: RedisConfig, tagged: Sequence[str] = ()
) -> None:
    """Log what a full Redis will do to the cache (``_memory_policy``), and to its
    ``tagged`` namespaces: once, bounded, never failing the start."""
    await log_memory_policies(client, start_wait(redis), tagged)


async def check_database(client: RedisClient, redis: RedisConfig) -> None:
    """A database the server doesn't have (``/16`` where ``databases`` is 16) fails every
    command (each logged per key as ``l2_key_error``) and nothing is ever cached, while
    the breaker stays closed: the server answers. Said once at start, as an error with
    the fix. Never fails the start."""
    try:
        await asyncio.wait_for(client.ping(), start_wait(redis))
    except ResponseError as exc:
        if "DB index" in str(exc):
            _log.error(
                "redis_database_refused",
                error=error_text(exc),
                fix="use a database the server has: its `databases` setting (16 by "
                "default) counts them from 0",
            )
    except REDIS_FAILURES:
        pass  # unknown: nothing to say


async def check_transactions(client: RedisClient, redis: RedisConfig) -> bool:
    """Whether the cache's Redis user may run MULTI/EXEC, which set_many, a hot key's
    set() and replica reservations send on a single node (``_write_commands``). An ACL
    that refuses MULTI lets the commands after it run one by one, not atomically, and
    set_many then raises NOPERM: said once at start, as an error with the fix, rather
    than at the first set_many. Never fails the start (a Redis that doesn't answer is
    left to the breaker)."""
    if isinstance(client, RedisCluster):
        return True  # a cluster's writes are scripts per slot: no MULTI
    pipe = client.pipeline(transaction=True)
    pipe.ping()
    try:
        await asyncio.wait_for(pipe.execute(), start_wait(redis))
    except ResponseError as exc:
        # redis-py reports a refused MULTI by what follows it (the PING ran on its own,
        # and EXEC found no transaction), a refused EXEC as an EXECABORT naming NOPERM.
        text = str(exc)
        if not isinstance(exc, NoPermissionError) and not (
            "NOPERM" in text or "EXEC without MULTI" in text
        ):
            return True
        _log.error(
            "redis_transactions_refused",
            error=error_text(exc),
            fix="grant the cache's Redis user +multi +exec (set_many and hot-key writes "
            "are MULTI/EXEC on a single node)",
        )
        return False
    except REDIS_FAILURES:
        return True  # unknown: nothing to say
    return True


async def listening(
    listener: BackplaneListener, fallback: FallbackSubscriber, seconds: float
) -> None:
    """``positioned``, and the fallback channel subscribed (``_fallback``): both bounded,
    waited for together so that a Redis that is down delays the start only once."""
    await asyncio.gather(positioned(listener, seconds), subscribed(fallback, seconds))


class OneAtATime:
    """``start()`` calls of one event loop run one after the other: a second that came
    while the first waited on Redis (two lifespans sharing a module's cache, a lazy
    start hit by two requests at once) then does what a second start does, nothing.
    Overlapping, it counted as a close() for the first, which raised and closed the
    cache. One left by a loop that ended is not waited for."""

    def __init__(self) -> None:
        self._running: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        # Every close() running (one inside a start() that failed, beside the close()
        # that made it fail): a start() waits for them all.
        self._closing: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        while (waited := self._busy(loop)) is not None:
            await waited.wait()
        done = asyncio.Event()
        self._running = (loop, done)
        try:
            yield
        finally:
            self._running = None
            done.set()

    @contextlib.asynccontextmanager
    async def closing(self) -> AsyncIterator[None]:
        """Around ``close()``: a ``start()`` waits for it to end. One that returned while
        a close() was still at its awaits got its work undone by the close's end (its
        followers cancelled, every later load stored nowhere). A close() doesn't wait
        for a start (it overtakes it, and that start raises)."""
        held = (asyncio.get_running_loop(), asyncio.Event())
        self._closing.append(held)
        try:
            yield
        finally:
            self._closing.remove(held)
            held[1].set()

    def _busy(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event | None:
        for held in (*self._closing, self._running):
            if held is not None and held[0] is loop and not held[1].is_set():
                return held[1]
        return None


def runtime(
    config: Config,
    parts: CacheParts,
    clock: Callable[[], float],
    rand: Callable[[], float],
    purger: Purger | None,
) -> Runtime:
    """What a cache's namespaces share, built on ``parts`` (no I/O yet)."""
    return Runtime(
        store=parts.store,
        leases=LeaseWaiter(parts.store, parts.notifier),
        invalidator=Invalidator(parts.store, parts.publisher),
        clock=clock,
        rand=rand,
        versions=TagVersions(parts.store, config.redis.prefix, version_ttl(config)),
        prefix=config.redis.prefix,
        admission=asyncio.Semaphore(config.redis.max_connections),
        purges=purges_for(config, purger),  # HTTP caches: docs/http.md
    )


def reopened(
    parts: CacheParts, runtime: Runtime, coherence: Coherence, config: Config, purger: Purger | None
) -> None:
    """A closed cache started again (a second lifespan of a module-level cache, a test's
    new event loop): what was bound to the loop it ran on, or closed with it, is made
    anew. An asyncio lock, semaphore or queue is bound to the first loop that waits on
    it, and the purge queue's own Varnish client was closed (the clients themselves
    reconnect; the listener, fallback subscriber and hot-key reporter: ``_follow``).
    Background tasks an ended loop left pending are forgotten, not cancelled.
    L1 and the tag versions are dropped: the new listener starts at the stream's end,
    and whatever was invalidated while the cache was closed never reached it."""
    coherence.forget_all()
    runtime.tasks.forget_other_loops()
    runtime.leases.reopen()
    parts.notifier.reopen()
    parts.store.slots = asyncio.Semaphore(parts.store.max_in_flight)
    runtime.admission = asyncio.Semaphore(config.redis.max_connections)
    # purge_stats() counts on across restarts; queues a close() didn't end (their loop
    # ended first) count what they held.
    runtime.purges.abandon()
    runtime.purges = purges_for(config, purger, stats=runtime.purges.stats)


def started_elsewhere(started_in: int) -> str:
    """Why a cache started in another process, this one's parent, is refused here."""
    return (
        f"this LayeredCache was started in process {started_in}, before this one "
        "was forked from it: its connections are that process's. Build one cache "
        "per process (in the worker, e.g. in its lifespan), or start it only after "
        "the fork"
    )


def forked(parts: CacheParts, started_in: int) -> None:
    """A cache built in one process and started in a child forked from it (gunicorn
    ``--preload`` imports the app, and so builds the cache, in the master). Every worker
    then had the master's instance id, the ``origin`` of its backplane entries, and
    each worker's listener skipped the others' entries as its own: a write in one was
    never dropped from another's L1. The child takes an id of its own; ``reopened``,
    which follows, drops the L1 it was born with (it missed every invalidation since
    the fork). A cache the parent had *started* holds the parent's connections and
    tasks: refused, not shared."""
    if started_in:
        raise RuntimeError(started_elsewhere(started_in))
    parts.instance_id = new_instance_id()
    if parts.publisher is not None:
        parts.publisher.origin = parts.instance_id


def hot_key_reporter(
    parts: CacheParts, prefix: str, hot_keys: Callable[[], dict[str, dict[str, float]]] | None
) -> HotKeyReporter | None:
    """This instance's fleet hot-key report under its instance id; None if no namespace
    detects hot keys (``hot_keys`` None)."""
    if hot_keys is None:
        return None
    return HotKeyReporter(parts.client, hot_report_name(prefix, parts.instance_id), hot_keys)


def followers(
    parts: CacheParts, coherence: Coherence, config: Config, rt: Runtime
) -> tuple[BackplaneListener | None, FallbackSubscriber | None]:
    """What keeps L1 coherent with the fleet: the backplane stream's reader and the
    fallback channel's subscriber (``_fallback``); both None with the backplane off.
    A listener command may take its block time plus a connect plus a second: the bound
    its client's socket timeouts used to give (``_clients.listener_connection``). The
    listener vouches for the tag versions this instance holds (``_tags``)."""
    backplane, redis = config.backplane, config.redis
    versions, unsettled = rt.versions, rt.unsettled
    if parts.listener_client is None or parts.stream is None or parts.fallback_client is None:
        versions.vouch_with(None)
        return None, None
    listener = BackplaneListener(
        parts.listener_client,
        parts.stream,
        on_keys=coherence.apply_remote,
        on_gap=coherence.lost_track,
        on_tags=coherence.apply_tags,
        clock=rt.clock,  # Redis's time: stream IDs are its clock's, not this host's
        block=backplane.block,
        coalesce=backplane.coalesce,
        maxlen=backplane.maxlen,
        origin=parts.instance_id,
        timeout=redis.connect_timeout + 1.0,
        unsettled=unsettled,
    )
    fallback = FallbackSubscriber(
        parts.fallback_client,
        fallback_channel(parts.stream),
        on_keys=coherence.apply_remote,
        on_tags=coherence.apply_tags,
        on_error=coherence.forget_all,
        origin=parts.instance_id,
        on_subscribed=versions.forget_all,
        timeout=redis.timeout,
        unsettled=unsettled,
    )
    # Invalidations come by either way (a writer whose XADD Redis refused publishes
    # them), so the two vouch together: as of the older of their words.
    versions.vouch_with(lambda: min(listener.known_as_of(), fallback.known_as_of()))
    return listener, fallback
