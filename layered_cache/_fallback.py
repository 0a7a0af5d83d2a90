"""The backplane's fallback: invalidations over pub/sub when the stream refuses them.

A Redis full under ``noeviction`` (or ``volatile-*`` with nothing left to evict)
refuses XADD ("OOM command not allowed"), but DEL and PUBLISH still run: neither is a
``denyoom`` command, and a PUBLISH stores nothing. So once the L2 names are deleted,
an announcement the stream refused goes to the channel ``<stream>:fallback`` instead,
which every instance's ``FallbackSubscriber`` follows next to its stream reader. The
other instances drop their L1 copies just the same.

Pub/sub is at-most-once: an instance disconnected from Redis at that moment misses the
message, and keeps its L1 copy for at most its ``l1.ttl`` (the bound documented in
docs/operations.md, "Redis under memory pressure"). In a cluster, classic PUBLISH is
broadcast over the cluster bus, so subscribing on one node sees every message.

A subscribed connection is idle until a full Redis refuses an XADD, and one that dies
without a reset (a NAT or firewall dropping an idle flow) would look subscribed for
ever: the subscriber PINGs it every ``PING_EVERY`` seconds and, with no PONG within
``redis.timeout``, stops vouching for the tag versions held and subscribes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
import redis.asyncio as redis
import structlog

from layered_cache._backoff import Backoff
from layered_cache._clients import RedisClient, is_redis_failure, stop_if_cancelled
from layered_cache._codec import UNDECODABLE
from layered_cache._logs import error_text
from layered_cache._unsettled import UnsettledWrites

__all__ = [
    "PING_EVERY",
    "FallbackChannel",
    "FallbackMessage",
    "FallbackSubscriber",
    "fallback_channel",
    "subscribed",
]

_log = structlog.get_logger("layered_cache.backplane")
_LOG_EVERY = 1.0  # seconds between two degraded-delivery warnings (an OOM storm is one)
# Seconds between two PINGs on a subscription (docs/operations.md): each instance's costs
# its Redis one PING per 2 s, and a connection dead without a reset is found within this
# plus ``redis.timeout`` (``_Heartbeat``).
PING_EVERY = 2.0


def fallback_channel(stream: str) -> str:
    """The pub/sub channel that backs up the stream ``stream`` (a channel, not a key:
    it takes no memory and is never evicted)."""
    return f"{stream}:fallback"


class FallbackMessage(msgspec.Struct, frozen=True):
    keys: list[str]
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    origin: str = ""


class FallbackChannel:
    """Publishes what the stream refused; counts and logs each degraded delivery."""

    def __init__(self, client: RedisClient, channel: str, origin: str = "") -> None:
        self._client = client
        self.channel = channel
        self._origin = origin
        self.deliveries = 0  # announcements that went over pub/sub instead of the stream
        self._logged_at = -_LOG_EVERY

    async def deliver(
        self, keys: Sequence[str], tags: Mapping[str, str] | None, refused: BaseException
    ) -> None:
        """PUBLISH the announcement the stream refused (``refused``). Raises the Redis
        error when PUBLISH fails too: then no instance can be told."""
        payload = msgspec.msgpack.encode(
            FallbackMessage(list(keys), dict(tags or {}), self._origin)
        )
        await self._client.publish(self.channel, payload)
        self.delivered(len(keys), len(tags or {}), error_text(refused))

    def delivered(self, keys: int, tags: int, error: str) -> None:
        """Count (and log) one degraded delivery: ours, or one a write's own script
        published (``WRITE_ONE_SCRIPT``)."""
        self.deliveries += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            self._logged_at = now
            _log.warning(
                "backplane_append_failed_delivered_over_pubsub",
                error=error,
                keys=keys,
                tags=tags,
                degraded_total=self.deliveries,
            )


class _Heartbeat:
    """Whether a subscribed connection still delivers: a PING every ``every`` seconds,
    its PONG due within ``timeout`` (the SUBSCRIBE's reply counts as the first). Replies
    come in order, so a PONG also says that every message published before its PING
    was sent has arrived."""

    def __init__(self, every: float, timeout: float) -> None:
        self._every, self._timeout = every, timeout
        self._sent: float | None = None  # when the command awaiting its reply went out
        self._next = 0.0  # when the next PING is due
        self.alive_at = float("-inf")  # the last moment known to have delivered all

    def sent(self) -> None:
        self._sent = time.monotonic()

    def answered(self) -> None:
        if self._sent is not None:
            self.alive_at, self._sent = self._sent, None
        self._next = time.monotonic() + self._every

    def due(self) -> bool:
        return self._sent is None and time.monotonic() >= self._next

    def live(self) -> bool:
        """No reply overdue."""
        return self._sent is None or time.monotonic() - self._sent <= self._timeout

    def wait(self, overdue: bool) -> float:
        """How long to wait for a message before looking again. Once the reply is
        overdue, ``timeout`` more: only a wait begun then that brings nothing says the
        link is dead (a reply on its way while the event loop was held still counts)."""
        if overdue:
            return self._timeout
        until = self._next if self._sent is None else self._sent + self._timeout
        return max(until - time.monotonic(), 0.001)

    def dead(self) -> TimeoutError:
        _log.warning("fallback_subscription_unanswered", timeout=self._timeout)
        return TimeoutError(f"no reply on the fallback subscription in {self._timeout:g}s")


class FallbackSubscriber:
    """Follows the fallback channel and applies its messages like stream entries."""

    def __init__(
        self,
        client: redis.Redis,
        channel: str,
        on_keys: Callable[[list[str]], None],
        on_tags: Callable[[dict[str, str]], None],
        on_error: Callable[[], None] = lambda: None,
        origin: str = "",
        on_subscribed: Callable[[], None] = lambda: None,
        timeout: float = 0.1,
        unsettled: UnsettledWrites | None = None,
    ) -> None:
        self._client = client
        self._channel = channel
        self._unsettled = UnsettledWrites() if unsettled is None else unsettled
        self._on_keys = on_keys
        self._on_tags = on_tags
        self._on_error = on_error  # clears L1 (``_apply`` says when)
        self._on_subscribed = on_subscribed  # forgets the tag versions held (``_subscribed``)
        self._origin = origin
        self.subscribed = asyncio.Event()
        self._lost_at = float("-inf")  # monotonic time the subscription last ended
        self._heartbeat = _Heartbeat(PING_EVERY, timeout)
        self.received = 0  # messages from others applied
        self.errors = 0  # bugs met applying a message (each cleared L1)
        self.clears = 0  # messages it could not read (each cleared L1: a gap, not a bug)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="layered_cache._fallback")

    def cancel(self) -> None:
        """Cancel the subscriber without waiting (``LayeredCache.close`` cut short before or
        while ``stop`` ran: the clients are closed next, which it would reopen)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        """Never hangs: the connection is closed to unblock a pending read."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(Exception):
            await self._client.aclose()
        await asyncio.wait({task}, timeout=1.0)

    async def _run(self) -> None:
        backoff = Backoff(base=0.05, cap=2.0)
        while True:
            stop_if_cancelled()
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                await self._read(pubsub, backoff)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_redis_failure(exc):
                    raise
                _log.debug("fallback_subscriber_failed", error=type(exc).__name__)
            finally:
                if self.subscribed.is_set():
                    self._lost_at = self._heartbeat.alive_at
                self.subscribed.clear()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), 0.1)  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2
            await asyncio.sleep(backoff.next_delay())

    def known_as_of(self) -> float:
        """As of when no fallback message can have passed us by (``_tags``): now while
        subscribed (the versions held before it are forgotten: ``_subscribed``) and no
        PONG is overdue, else when the link was last known to deliver (never: minus
        infinity)."""
        if not self.subscribed.is_set():
            return self._lost_at
        heartbeat = self._heartbeat
        return time.monotonic() if heartbeat.live() else heartbeat.alive_at

    def _subscribed(self) -> None:
        """From now on no message passes us by; before, one may have (the subscription
        lost, or not yet made), and what it invalidated is unknown. Vouching "now" for
        the tag versions held then, fetched before such a message, trusted them for the
        hour a version is held (a review, 2026-12-05): they are forgotten instead, and
        fetched again. (A key it dropped from L1 lives at most its L1 TTL there: its L2
        copy was deleted before the message was sent.)"""
        self._on_subscribed()
        self.subscribed.set()

    async def _read(self, pubsub: redis.client.PubSub, backoff: Backoff) -> None:
        heartbeat = self._heartbeat
        heartbeat.sent()  # the SUBSCRIBE
        while True:
            stop_if_cancelled()
            if heartbeat.due():
                await pubsub.ping()
                heartbeat.sent()
            overdue = not heartbeat.live()
            wait = heartbeat.wait(overdue)
            message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=wait)
            if message is None:
                if overdue:  # dead without a reset: subscribe again (``_run``)
                    raise heartbeat.dead()
                continue
            if message["type"] in ("subscribe", "pong"):
                heartbeat.answered()
            if message["type"] == "subscribe":
                self._subscribed()
                backoff.reset()
            elif message["type"] == "message" and _text(message["channel"]) == self._channel:
                # Only ours: on RESP2 the connection also gets what another client sends
                # it (``CLIENT TRACKING ... REDIRECT`` to it: "__redis__:invalidate", its
                # data a list), and decoding a list raised past every check: the
                # subscriber ended, and with it every later fallback announcement here.
                self._apply(message["data"])

    def _apply(self, data: object) -> None:
        try:
            if not isinstance(data, bytes):
                raise msgspec.DecodeError(f"not bytes but {type(data).__name__}")
            message = msgspec.msgpack.decode(data, type=FallbackMessage)
        except UNDECODABLE:
            # Another version's format, a forged message: it may name invalidations we
            # can't read, so L1 goes whole, as for such a stream entry (``_unreadable``).
            _log.warning("backplane_bad_fallback_message")
            self.clears += 1  # a whole-L1 clear, counted with the stream's gaps
            self._on_error()
            return
        if self._origin and message.origin == self._origin:
            # Our own: already applied locally, but for the keys of a write of ours that
            # may have landed after its caller left (``_unsettled``).
            keys = self._unsettled.pick(message.keys) if self._unsettled else []
            if not keys:
                return
            message = FallbackMessage(keys)
        try:
            if message.tags:
                self._on_tags(message.tags)
            if message.keys:
                self._on_keys(message.keys)
        except Exception as exc:
            # A bug (ours, or a hook's). Raising would end the subscriber unseen, and
            # this instance would miss every later fallback message; as the stream's
            # listener does (``BackplaneListener._failed``), L1 is cleared instead -
            # what the message was to drop goes with it - and the subscriber goes on.
            self.errors += 1
            _log.error("backplane_fallback_error", error=error_text(exc), exc_info=exc)
            self._on_error()
            return
        self.received += 1


async def subscribed(subscriber: FallbackSubscriber, seconds: float) -> None:
    """Wait (bounded) until the subscription is confirmed: from then on no fallback
    message is missed while Redis stays reachable."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(subscriber.subscribed.wait(), seconds)


def _text(channel: bytes | str) -> str:
    return channel.decode(errors="replace") if isinstance(channel, bytes) else channel
