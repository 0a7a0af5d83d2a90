"""Fill notifications: wake lease waiters when the winner's fill lands.

Waiters subscribe to ``{key}:filled`` on a shared pub/sub connection; the fill script
publishes the envelope there, so a waiter gets the value in the message itself and needs
no extra GET. Subscriptions are reference counted per channel and dropped when the last
waiter leaves; an UNSUBSCRIBE that fails drops the connection instead (redis-py would
subscribe the channel again on reconnecting, for nobody). A message can be lost
(reconnect, subscription racing the fill, a slot moved by a failover), so callers always
combine ``wait`` with jittered re-reads of L2.

The fill script publishes only when the node it runs on has a subscriber on the channel
(``PUBSUB NUMSUB``/``SHARDNUMSUB`` in the same atomic step), so a waiter must subscribe
on the node that runs the fill:

- single node: classic SUBSCRIBE on one connection per cache instance;
- cluster: sharded SSUBSCRIBE, on the master that owns the key's slot (the channel
  carries the key as hash tag), one connection per master (``ClusterFillNotifier``).
  Classic PUBLISH would be broadcast by the cluster bus to every node, the whole
  envelope each time: fills of 10 KB made the nodes of 3 masters + 3 replicas write 7.2x
  the value bytes (``bench/fill_bytes.py``). SPUBLISH reaches only the slot's own shard.

Why "subscribe, then re-read" stays race-free with the NUMSUB check: the subscription
is confirmed before the waiter's re-read; a fill that runs after the confirmation sees
the subscriber and publishes, a fill that ran before it is found by the re-read.

A waiter is confirmed by the PONG of a PING sent on the connection after it registered
(and after the SUBSCRIBE it sent, if it was the channel's first), and is handed only the
messages the reader reads after that PONG. Redis writes to a connection in order: a
message read before the PONG was published before Redis ran the PING, maybe before
the waiter's read began - the fill of a value an invalidation since killed, read off
the socket while an older waiter held the subscription and handed out only later (a
slow reader). Handed to the new waiter, its read (begun after the tombstone) kept
that value in L1 for the L1 TTL. A message after the PONG was published after the
waiter began.
The subscription's own reply can't confirm: a waiter joining a channel already
subscribed gets none, and after an UNSUBSCRIBE and a SUBSCRIBE the reply read may be
the one of an earlier SUBSCRIBE, with older messages behind it. Nor can the envelope's
``written_at``: hosts' clocks differ. Cost: one PING per waiter that subscribes or
joins, sent right after its SUBSCRIBE (pipelined: the first waiter's confirmation takes
the one round trip it took before); a waiter joining a subscribed channel, confirmed at
once before, now waits that round trip before its re-read. On a cluster master's
connection (SSUBSCRIBE) the same holds: the PING goes to that master, in order with its
SPUBLISHed messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import redis.asyncio as redis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from layered_cache._clients import REDIS_FAILURES, resurface_cancel

__all__ = ["ClusterFillNotifier", "FillNotifier", "Notifier", "Subscription"]

_log = structlog.get_logger("layered_cache.notify")

# The PINGs that confirm waiters carry this and their number (redis-py's own health
# check PINGs carry another message).
_PING = "layered_cache-fill:"


class Subscription:
    __slots__ = ("channel", "confirmed", "ping", "queue")

    def __init__(self, channel: str) -> None:
        self.channel = channel
        # Set by the notifier's reader at the PONG of PING number ``ping``; only the
        # messages read after it are queued (see the module's docstring).
        self.confirmed = asyncio.Event()
        self.ping = 0
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def wait(self, seconds: float) -> bytes | None:
        """The next published envelope, or None after ``seconds``."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can drop a cancellation
        # that arrives as the message does (see ``_clients.resurface_cancel``).
        try:
            async with asyncio.timeout(seconds):
                return await self.queue.get()
        except TimeoutError:
            return None


class Notifier(Protocol):
    """What a lease waiter needs: a bounded subscription, and closing at shutdown."""

    def subscribe(
        self, channel: str, confirm_timeout: float
    ) -> contextlib.AbstractAsyncContextManager[Subscription]: ...

    async def close(self) -> None: ...

    def reopen(self) -> None:
        """After ``close``, for a cache started again (maybe on another event loop)."""


class FillNotifier:
    """One pub/sub connection (to one node) shared by every waiter of this cache
    instance; ``sharded``: SSUBSCRIBE instead of SUBSCRIBE (a cluster master)."""

    def __init__(self, client: redis.Redis, sharded: bool = False) -> None:
        self._client = client
        self._sharded = sharded
        self._pubsub = client.pubsub()
        self._waiters: dict[str, list[Subscription]] = {}
        # Channels whose subscription went with a replaced connection (``_reset``) while
        # waiters stayed: the next waiter on one subscribes again, for them all.
        self._lost: set[str] = set()
        self._chores: set[asyncio.Task[None]] = set()  # UNSUBSCRIBEs owed (``_remove``)
        # PINGs sent (numbered), and the waiters their PONGs are to confirm, in that order.
        self._pings = 0
        self._unconfirmed: deque[Subscription] = deque()
        self._closed = False  # no connection is opened again once closing began
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str, confirm_timeout: float) -> AsyncIterator[Subscription]:
        """Subscribe for the duration of the block; waits (bounded) for Redis to confirm
        the subscription so that a re-read after it cannot miss a fill in between."""
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        sub = Subscription(channel)
        # The registration is undone on every way out, a cancellation while subscribing
        # included: a waiter left in ``_waiters`` kept the reader alive for ever and, after
        # a ``_reset``, made later waiters on its channel count as subscribed.
        try:
            try:
                # One bound for connecting, SUBSCRIBE and its confirmation: a waiter must
                # never wait on pub/sub longer than it would re-read L2 (the socket
                # timeout bounds each step too; this bounds their sum).
                async with asyncio.timeout(confirm_timeout):
                    await self._add(sub)
                    # SUBSCRIBE goes through redis-py's ``wait_for``: a cancel that landed
                    # as it completed is lost on Python 3.11, and the waiter ran on to
                    # max_wait and its own loader.
                    resurface_cancel(task, requested)
                    await sub.confirmed.wait()
            except TimeoutError:
                _log.debug("fill_subscribe_timeout", channel=channel)
            except REDIS_FAILURES as exc:
                _log.debug("fill_subscribe_failed", error=type(exc).__name__)
            yield sub
        finally:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(confirm_timeout):
                    await self._remove(sub)
        resurface_cancel(task, requested)  # UNSUBSCRIBE too goes through ``wait_for``

    async def _add(self, sub: Subscription) -> None:
        if self._closed:
            return  # a waiter of a closing cache: its re-reads will do (no new connection)
        async with self._lock:
            waiters = self._waiters.setdefault(sub.channel, [])
            waiters.append(sub)
            # Another waiter subscribed the channel already: it needs only its PING.
            subscribed = len(waiters) > 1 and sub.channel not in self._lost
            self._lost.discard(sub.channel)
            try:
                if not subscribed:
                    pubsub = self._pubsub
                    await (pubsub.ssubscribe if self._sharded else pubsub.subscribe)(sub.channel)
                await self._ping(sub)  # sent after the SUBSCRIBE: its PONG comes after its reply
            except asyncio.CancelledError:
                # Timed out mid-connect or mid-command: the connection's state is
                # unknown (a half-read handshake), so it is not reused. The channel
                # goes with it: nothing for ``_remove`` to unsubscribe.
                self._unregister(sub)
                await self._reset()
                raise
            except REDIS_FAILURES:
                # Not subscribed (Redis down): the channel's next waiter must try again
                # rather than count as subscribed while this one is still registered.
                self._lost.add(sub.channel)
                raise
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="layered_cache._notify")

    async def _ping(self, sub: Subscription) -> None:
        """Send the PING whose PONG confirms ``sub`` (the lock is held). It is queued for
        confirmation first: the reader may read the PONG before the send returns."""
        self._pings += 1
        sub.ping = self._pings
        self._unconfirmed.append(sub)
        await self._pubsub.ping(f"{_PING}{self._pings}")

    def _confirm(self, data: bytes | str) -> None:
        """A PONG read: every waiter registered before its PING is confirmed. PONGs come
        in the order of their PINGs; a PING lost with a connection confirms nobody, a
        later one's PONG confirms its waiters too."""
        text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        number = text.removeprefix(_PING)
        if number == text or not number.isdigit():
            return  # not ours (redis-py's health check)
        while self._unconfirmed and self._unconfirmed[0].ping <= int(number):
            self._unconfirmed.popleft().confirmed.set()

    def _unregister(self, sub: Subscription) -> bool:
        """Drop ``sub`` from ``_waiters``; whether it was its channel's last waiter."""
        waiters = self._waiters.get(sub.channel)
        if waiters is None or sub not in waiters:
            return False
        waiters.remove(sub)
        if waiters:
            return False
        del self._waiters[sub.channel]
        self._lost.discard(sub.channel)
        return True

    async def _remove(self, sub: Subscription) -> None:
        # Unregistered before waiting for the lock: a cancel or a timeout while waiting
        # must not leave the waiter registered.
        if not self._unregister(sub):
            return  # other waiters still use the subscription, or it never was made
        try:
            await self._lock.acquire()
        except asyncio.CancelledError:
            # Cancelled (or timed out) waiting for the lock: the UNSUBSCRIBE is still
            # owed. Skipped, the channel stayed subscribed with nobody waiting: fills
            # kept publishing to it and the reader never ended.
            chore = asyncio.create_task(self._unsubscribe_later(sub.channel))
            self._chores.add(chore)
            chore.add_done_callback(self._chores.discard)
            raise
        try:
            await self._unsubscribe(sub.channel)
        finally:
            self._lock.release()

    async def _unsubscribe_later(self, channel: str) -> None:
        with contextlib.suppress(Exception):
            async with self._lock:
                await self._unsubscribe(channel)

    async def _unsubscribe(self, channel: str) -> None:
        """UNSUBSCRIBE ``channel`` unless a waiter subscribed again meanwhile; the lock
        is held."""
        if channel in self._waiters or self._closed:
            return
        if self._pubsub.connection is None:
            return  # connection replaced (``_reset``) since: nothing subscribed on this one
        try:
            if self._sharded:
                await self._pubsub.sunsubscribe(channel)
            else:
                await self._pubsub.unsubscribe(channel)
        except REDIS_FAILURES as exc:
            # Not unsubscribed (Redis down, say): redis-py still counts the channel as
            # subscribed and subscribes it again when its connection comes back, with
            # nobody left to unsubscribe it: every outage added the channels of the
            # waiters it ended, for good. The connection goes, and the channel with it.
            _log.debug("fill_unsubscribe_failed", error=type(exc).__name__)
            await self._reset()
        except asyncio.CancelledError:
            await self._reset()  # timed out mid-command: don't reuse the connection
            raise

    async def _reset(self) -> None:
        """Replace the pub/sub connection. Other waiters' subscriptions are lost with it;
        they fall back to their jittered re-reads (a lost message costs no more), and the
        next waiter on one of their channels subscribes again instead of counting as
        subscribed (it would have been woken by nothing but its re-reads too)."""
        self._lost.update(self._waiters)
        # The reader goes too: left running, it would read the new connection while the
        # next SUBSCRIBE on it reads its own reply (redis-py: "readuntil() called while
        # another coroutine is already waiting"). ``_add`` starts one after subscribing.
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        old, self._pubsub = self._pubsub, self._client.pubsub()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.aclose(), 0.1)  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2

    async def _read(self) -> None:
        while self._waiters or self._pubsub.subscribed:
            try:
                message = await self._pubsub.get_message(
                    ignore_subscribe_messages=False, timeout=1.0
                )
            except (*REDIS_FAILURES, RuntimeError) as exc:  # RuntimeError: reset, no connection yet
                _log.debug("fill_notifier_read_failed", error=type(exc).__name__)
                await asyncio.sleep(0.1)
                continue
            if message is None:
                continue
            if message["type"] == "pong":
                self._confirm(message["data"])
                continue
            # Subscribe replies confirm nobody (the PONGs do). A server-sent
            # "sunsubscribe" (the slot moved away in a failover or a resharding) needs
            # nothing: the waiter's re-reads carry on without messages.
            if message["type"] not in ("message", "smessage"):
                continue
            channel = message["channel"]
            name = channel.decode() if isinstance(channel, bytes) else str(channel)
            for sub in self._waiters.get(name, ()):
                if sub.confirmed.is_set():  # else read before its PONG: maybe older than it
                    sub.queue.put_nowait(message["data"])

    def reopen(self) -> None:
        """Subscribe again (``close`` had stopped that for good), with a lock and a
        pub/sub of the running event loop."""
        self._closed = False
        self._pubsub = self._client.pubsub()
        self._waiters.clear()
        self._lost.clear()
        self._unconfirmed.clear()
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        """Never hangs: a reader cancelled inside a blocking read may only wake once its
        socket is closed, so the connections are closed before waiting (bounded)."""
        self._closed = True
        for chore in list(self._chores):
            chore.cancel()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2
        with contextlib.suppress(Exception):
            await self._client.aclose()
        if reader is not None:
            await asyncio.wait({reader}, timeout=1.0)


class ClusterFillNotifier:
    """Sharded fill notifications in a cluster: each channel is SSUBSCRIBEd on the
    master that owns its slot, over one connection per master (made on first use).

    The owner comes from the cluster client's slot map, which the waiter's lost
    ``SET NX`` of the lease (same slot) has just used. A map not known yet, or stale
    after a failover (the old master answers MOVED, or later drops the subscription
    with a "sunsubscribe"), costs no more than a lost message: the waiter's jittered
    re-reads find the fill. Connections to nodes that left the map stay until close;
    a cluster has few masters.
    """

    def __init__(self, cluster: RedisCluster, node_client: Callable[[str], redis.Redis]) -> None:
        self._cluster = cluster
        self._node_client = node_client
        self._nodes: dict[str, FillNotifier] = {}

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str, confirm_timeout: float) -> AsyncIterator[Subscription]:
        notifier = self._owner(channel)
        if notifier is None:
            yield Subscription(channel)  # never notified: the waiter re-reads
            return
        async with notifier.subscribe(channel, confirm_timeout) as sub:
            yield sub

    def _owner(self, channel: str) -> FillNotifier | None:
        nodes = self._cluster.nodes_manager.slots_cache.get(key_slot(channel.encode()))
        if not nodes:
            return None
        name = nodes[0].name
        notifier = self._nodes.get(name)
        if notifier is None:
            notifier = self._nodes[name] = FillNotifier(self._node_client(name), sharded=True)
        return notifier

    async def close(self) -> None:
        notifiers, self._nodes = list(self._nodes.values()), {}
        await asyncio.gather(*(notifier.close() for notifier in notifiers))

    def reopen(self) -> None:
        """Nothing to do: ``close`` forgot every node's notifier; new ones are made."""
