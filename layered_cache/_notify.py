"""Fill notifications: wake lease waiters when the winner's fill lands.

Waiters SUBSCRIBE to ``{key}:filled`` on one shared pub/sub connection per cache
instance; the fill script PUBLISHes the envelope there, so a waiter gets the value in the
message itself and needs no extra GET. Subscriptions are reference counted per channel
and dropped when the last waiter leaves. A message can be lost (reconnect, subscription
racing the fill), so callers always combine ``wait`` with jittered re-reads of L2.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as redis
import structlog

from layered_cache._clients import REDIS_FAILURES

__all__ = ["FillNotifier"]

_log = structlog.get_logger("layered_cache.notify")


class _Subscription:
    __slots__ = ("channel", "confirmed", "queue")

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.confirmed = asyncio.Event()
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


class FillNotifier:
    """One pub/sub connection shared by every waiter of this cache instance."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pubsub = client.pubsub()
        self._waiters: dict[str, list[_Subscription]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str, confirm_timeout: float) -> AsyncIterator[_Subscription]:
        """Subscribe for the duration of the block; waits (bounded) for Redis to confirm
        the subscription so that a re-read after it cannot miss a fill in between."""
        sub = _Subscription(channel)
        try:
            # One bound for connecting, SUBSCRIBE and its confirmation: a waiter must
            # never wait on pub/sub longer than it would re-read L2 (the socket timeout
            # bounds each step too; this bounds their sum).
            async with asyncio.timeout(confirm_timeout):
                await self._add(sub)
                await sub.confirmed.wait()
        except TimeoutError:
            _log.debug("fill_subscribe_timeout", channel=channel)
        except REDIS_FAILURES as exc:
            _log.debug("fill_subscribe_failed", error=type(exc).__name__)
        try:
            yield sub
        finally:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(confirm_timeout):
                    await self._remove(sub)

    async def _add(self, sub: _Subscription) -> None:
        async with self._lock:
            waiters = self._waiters.setdefault(sub.channel, [])
            waiters.append(sub)
            if len(waiters) > 1:
                sub.confirmed.set()
                return
            try:
                await self._pubsub.subscribe(sub.channel)
            except asyncio.CancelledError:
                # Timed out mid-connect or mid-command: the connection's state is
                # unknown (a half-read handshake), so it is not reused.
                await self._reset()
                raise
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="layered_cache._notify")

    async def _remove(self, sub: _Subscription) -> None:
        async with self._lock:
            waiters = self._waiters.get(sub.channel, [])
            if sub in waiters:
                waiters.remove(sub)
            if waiters:
                return
            self._waiters.pop(sub.channel, None)
            try:
                with contextlib.suppress(*REDIS_FAILURES):
                    await self._pubsub.unsubscribe(sub.channel)
            except asyncio.CancelledError:
                await self._reset()  # timed out mid-command: don't reuse the connection
                raise

    async def _reset(self) -> None:
        """Replace the pub/sub connection. Other waiters' subscriptions are lost with it;
        they fall back to their jittered re-reads (a lost message costs no more)."""
        old, self._pubsub = self._pubsub, self._client.pubsub()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.aclose(), 0.1)  # type: ignore[no-untyped-call]

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
            channel = message["channel"]
            name = channel.decode() if isinstance(channel, bytes) else str(channel)
            for sub in self._waiters.get(name, ()):
                if message["type"] == "subscribe":
                    sub.confirmed.set()
                elif message["type"] == "message":
                    sub.queue.put_nowait(message["data"])

    async def close(self) -> None:
        """Never hangs: a reader cancelled inside a blocking read may only wake once its
        socket is closed, so the connections are closed before waiting (bounded)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            await self._client.aclose()
        if reader is not None:
            await asyncio.wait({reader}, timeout=1.0)
