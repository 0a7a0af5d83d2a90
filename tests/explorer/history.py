"""What happened in one schedule, and the rule every read is checked against.

Time is logical: one counter, bumped at every event (single-threaded asyncio makes the
order exact). The database holds a version per key; every write bumps it and then
tells the cache (``invalidate()``, ``set()`` or the daemon's ``Invalidator``).

The guarantee (README, "What is guaranteed"; the soak checks the same rule in wall
time): a read that *began* after write ``w`` was committed and known to the reading
instance must not return a version that ``w`` superseded. Precisely, a read on instance
``I`` that began at ``t`` and returned version ``v`` violates it if some write ``w`` has

- ``w.version > v`` and the write of ``v`` had ended before ``w`` began (concurrent
  writes of one key have no defined order; only a strictly earlier one is superseded);
- ``w`` returned successfully before ``t`` (``invalidate``/``set`` returned, the daemon
  "committed"); a write that failed promises nothing;
- ``w`` had reached ``I`` before ``t``: immediately if ``w`` ran on ``I``, or if ``I`` has
  no L1 and the read did not join a load already in flight in ``I`` (single-flight);
  otherwise once ``I``'s backplane listener had read an entry at or after ``w``'s own
  entry (the documented bound for other instances is backplane delivery). A joined load
  is an in-process copy like L1: another instance's invalidation detaches it when the
  backplane delivers it, not before (README, "Invalidation wins everywhere").

A fallback value (the fail-safe served it because the read's own load failed or was
still running, ``load_timeout``) is held to a stricter rule: an invalidated value is
never a fallback, so it violates if such a write had reached the instance before the
read *returned*, whenever the read began.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["History", "Read", "Write"]


@dataclass
class Write:
    version: int
    kind: str
    key: str
    instance: str | None  # the instance that ran it (None: the daemon)
    began: int
    ended: int | None = None
    ok: bool = False
    entry_id: tuple[int, int] | None = None  # its backplane entry


@dataclass
class Read:
    kind: str
    key: str
    instance: str
    began: int
    ended: int
    version: int | None
    fallback: bool = False  # its own load failed or was still running: a stale fallback
    joined: bool = False  # it joined a load in flight in its process (single-flight)


@dataclass
class History:
    instances_without_l1: set[str] = field(default_factory=set)
    clock: int = 0
    writes: dict[tuple[str, int], Write] = field(default_factory=dict)
    reads: list[Read] = field(default_factory=list)
    # instance -> [(time, newest entry id its listener had read by then)]
    deliveries: dict[str, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    type_errors: list[str] = field(default_factory=list)

    def tick(self, text: str = "") -> int:
        self.clock += 1
        if text:
            self.events.append(f"{self.clock:5d} {text}")
        return self.clock

    def delivered(self, instance: str, entry_id: tuple[int, int]) -> None:
        when = self.tick(f"{instance} backplane read up to {entry_id}")
        self.deliveries.setdefault(instance, []).append((when, entry_id))

    def reached(self, write: Write, instance: str, before: int, joined: bool = False) -> bool:
        if not write.ok or write.ended is None or write.ended >= before:
            return False
        if write.instance == instance:
            return True
        if instance in self.instances_without_l1 and not joined:
            return True
        if write.entry_id is None:
            return False  # never announced: other instances were never told
        return any(
            when < before and newest >= write.entry_id
            for when, newest in self.deliveries.get(instance, ())
        )

    def violations(self) -> list[str]:
        found = []
        for read in self.reads:
            if read.version is None:
                continue
            source = self.writes.get((read.key, read.version))
            if source is None or source.ended is None:
                continue  # its write is still running: nothing can have superseded it
            deadline = read.ended if read.fallback else read.began
            for write in self.writes.values():
                if (
                    write.key == read.key
                    and write.version > read.version
                    and source.ended < write.began
                    and self.reached(write, read.instance, deadline, read.joined)
                ):
                    found.append(
                        f"{read.kind}@{read.instance} of {read.key} began at {read.began} "
                        f"and returned v{read.version}"
                        f"{' as a fallback' if read.fallback else ''} at {read.ended}, superseded by {write.kind} "
                        f"v{write.version} (began {write.began}, returned {write.ended})"
                    )
                    break
        return found
