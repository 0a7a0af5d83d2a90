"""Busy-polling for a reply that is microseconds away, instead of sleeping for it.

Why: a nearby Redis answers a request-path command (a GET, set()'s write script) in
~10-25 µs, but a client that waits for the answer in the event loop's ``epoll`` is put
to sleep, and waking it up costs more than the answer took. On the bench VM (2 vCPUs)
one ``SET`` round trip took ~56 µs when the client slept in ``epoll`` and ~22 µs when
it polled the socket with a zero timeout until the reply was there, for the same CPU:
the sleep and the wake-up are CPU too (``docs/benchmarks.md``). Linux's
``SO_BUSY_POLL`` does this inside the kernel, for NIC queues only; a loopback or a
virtual NIC gets no such help, so it is done here. After a command is sent and before
the event loop is asked to wait, ``BusyPoll.wait`` polls the socket for up to
``budget`` (``redis.busy_poll``); then the loop's own ``epoll`` finds the reply there
and returns without sleeping.

When not to spin:

- Other work is ready on the event loop: it is better spent on that, and its own time
  hides the round trip anyway (``loop_is_idle``: asyncio's ready queue is empty; on a
  loop that doesn't show its queue, uvloop, this is the only command in flight).
- The Redis is further away (another host: a round trip of 100 µs and more), so every
  spin would burn its whole budget for nothing. The spin adapts as an adaptive mutex
  does: a spin that ends without the reply doubles the number of following commands
  that don't spin (up to ``MAX_SKIP``), and a reply within the budget resets it. Against
  a remote Redis that is one wasted budget per ``MAX_SKIP`` commands.
- A command that may block (the backplane listener's ``XREAD BLOCK``): its
  ``HeldConnection`` has no ``BusyPoll``.

No await in here: a spin adds no point where the caller could be cancelled or another
task could run; it only delays the event loop's next iteration by at most ``budget``.
"""

from __future__ import annotations

import select
import time

from layered_cache._readyqueue import ready_count

__all__ = ["AVAILABLE", "MAX_SKIP", "BusyPoll", "SocketPoll"]

MAX_SKIP = 1024  # commands without a spin after a run of spins that found nothing
AVAILABLE = hasattr(select, "poll")  # not on Windows: there the cache never spins


class SocketPoll:
    """A zero-timeout readability check of one socket (``select.poll``: one syscall, no
    lists built per call as ``select.select`` does)."""

    def __init__(self, fileno: int) -> None:
        self.fileno = fileno
        self._poll = select.poll()
        self._poll.register(fileno, select.POLLIN)

    def ready(self) -> bool:
        """Readable, closed or in error: anything the event loop must handle now."""
        return bool(self._poll.poll(0))


class BusyPoll:
    """How long to spin for a reply (``budget``, seconds) and when to stop trying. One
    per ``DirectClient``: its connections all reach the same server."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.spins = 0  # spins that saw the reply arrive within the budget
        self.misses = 0  # spins that gave up: the loop's epoll waits for the rest
        self.in_flight = 0  # commands sent and not yet answered (``DirectClient``)
        self._skip = 0  # commands left that don't spin
        self._penalty = 0  # commands skipped after the last miss: doubled by the next

    def loop_is_idle(self) -> bool:
        """Whether the event loop has nothing to do but wait for this reply. uvloop
        (uvicorn's default event loop) hides its ready queue: there, a command alone in
        flight stands for an idle loop; with others in flight, their replies are work
        the spin would hold up."""
        ready = ready_count()
        return self.in_flight == 1 if ready is None else ready == 0

    def wait(self, socket: SocketPoll) -> None:
        """Return once ``socket`` is readable or ``budget`` has passed (or at once, while
        earlier misses say this server answers too slowly for a spin to pay)."""
        if self._skip:
            self._skip -= 1
            return
        deadline = time.perf_counter() + self.budget
        while not socket.ready():
            if time.perf_counter() >= deadline:
                self.misses += 1
                self._penalty = min(max(1, 2 * self._penalty), MAX_SKIP)
                self._skip = self._penalty
                return
        self.spins += 1
        self._penalty = 0
