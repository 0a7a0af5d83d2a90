"""What ``set()``'s write sends to a single node (``L2Store.write_many``), and why.

A write is one atomic step: the SETs of a key (and of its replicas, when it is hot),
the DELs of the leases it revokes (a fill in flight carries an older value and must
not land after it) and the backplane append (other instances drop their L1 copies).
Atomic, because two concurrent ``set()`` calls of a hot key must not interleave (the
base key could end with one writer's value and the replicas with the other's), and
because a full ``noeviction`` Redis must refuse all of it (nothing written) rather than
let the lease DELs through and refuse the SET. The SETs come first and the append
last: the append tells the others to read again, so it follows the values. A stream
that refuses the append (a WRONGTYPE name) leaves the SETs in place; the append's Lua
then publishes the entry on the pub/sub fallback channel itself (``_fallback``), in the
same step, whenever it lands: a write whose caller left before its reply (cancelled,
timed out) may land long after, and nobody is left to announce it then.

Two forms, the same guarantees:

- One key that is not hot, the common ``set()``: ``WRITE_ONE_SCRIPT`` (one command, one
  reply; the append under ``pcall``, the fallback's PUBLISH if it was refused).
- Anything more (``set_many``, a hot key with its replicas, replica-lease
  reservations): MULTI, plain SETs, one DEL, the append, EXEC. Not a script: inside one,
  every ``redis.call`` converts its arguments and its reply between Lua and Redis. For
  a ``set_many`` of 100 ~1 KB values Redis spent ~650 µs in the script against ~300
  µs running the same commands from a transaction (bench VM, ``INFO cpu``), and
  Redis's time is what every instance of a fleet shares; the ``set_many`` took ~790
  against ~620 µs. The transaction costs the client a reply per command (``+QUEUED``),
  read in one pass (``_direct``). A full Redis refuses every write command queued
  while it is over ``maxmemory`` and then the EXEC (EXECABORT), and refuses an EXEC
  whose transaction holds a write once it is over (EXECABORT naming OOM: ``_direct``
  raises the error it names): either way none of it runs, and the caller sees
  ``OutOfMemoryError``. The append is the one command that must branch (on a refused
  XADD, PUBLISH): an EVAL of ``APPEND_SCRIPT``, the same Lua as the script's append,
  which runs in its place in the EXEC (EVAL, not EVALSHA: a NOSCRIPT there, after a
  restart, would be an error nobody may read). Redis ran it in ~10 µs against a plain
  XADD's ~2.5 (``INFO commandstats``, local Redis): ~5 % of the EXEC of a ``set_many``
  of 100 ~1 KB values (~150 µs), whose wall time stayed within noise (~1.1 ms).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from layered_cache import _direct as direct
from layered_cache._packing import Packed
from layered_cache._scripts import APPEND_SCRIPT

if TYPE_CHECKING:
    from layered_cache._backplane import Announcement

__all__ = [
    "Append",
    "Write",
    "is_one_write",
    "one_write_args",
    "run_transaction",
    "script_append",
    "write_commands",
]

Write = tuple[Sequence[str], Sequence[str], bytes, int]  # (names, delete first, data, ms)
_APPEND = APPEND_SCRIPT.encode()  # packed as is by every transaction that announces


class Append(enum.Enum):
    """What became of a write's backplane entry (``L2Store.write_many``)."""

    DONE = "done"  # appended to the stream, or there was none to append
    PUBLISHED = "published"  # refused by the stream, published on the fallback instead
    REFUSED = "refused"  # refused by the stream, carried by nothing: the caller announces


def script_append(reply: object) -> Append:
    """``WRITE_ONE_SCRIPT``'s or ``APPEND_SCRIPT``'s reply: 1, the XADD's error in an
    array (published on the fallback channel), or the error alone."""
    if reply == 1:
        return Append.DONE
    return Append.PUBLISHED if isinstance(reply, list) else Append.REFUSED


def is_one_write(writes: Sequence[Write]) -> bool:
    """Whether ``writes`` is one name and its lease (a key that is not hot): the script."""
    return len(writes) == 1 and len(writes[0][0]) == 1 and len(writes[0][1]) == 1


def one_write_args(
    writes: Sequence[Write], announcement: Announcement | None
) -> tuple[list[str], list[bytes | str | int]] | None:
    """KEYS and ARGV of ``WRITE_ONE_SCRIPT`` when ``writes`` is one name and its lease
    (a key that is not hot), else None."""
    if not is_one_write(writes):
        return None
    (name,), (lease,), data, ttl_ms = writes[0]
    if announcement is None:
        return [name, lease], [data, ttl_ms]
    keys = [name, lease, announcement.stream]
    return keys, [data, ttl_ms, announcement.maxlen, *announcement.fields]


def write_commands(writes: Sequence[Write], announcement: Announcement | None) -> Packed:
    """The commands of the MULTI/EXEC form, in their order: every SET, one DEL of
    every revoked name, then the append."""
    commands = Packed()
    for names, _, data, ttl_ms in writes:
        for name in names:
            commands.add_set(name, data, ttl_ms)
    revoked = [name for _, deletes, _, _ in writes for name in deletes]
    if revoked:
        commands.add((b"DEL", *revoked))
    if announcement is not None:
        stream, maxlen, fields = announcement.stream, announcement.maxlen, announcement.fields
        commands.add((b"EVAL", _APPEND, 1, stream, maxlen, *fields))
    return commands


async def run_transaction(
    client: direct.DirectClient, writes: Sequence[Write], announcement: Announcement | None
) -> Append:
    """The MULTI/EXEC form, sent and read back. Returns what became of the append
    (``script_append``; REFUSED if the EVAL itself failed: the writes landed). A SET or
    the DEL that failed as EXEC ran (none can with these arguments: a SET overwrites
    any type) raises: the others may have landed."""
    replies = await direct.execute_transaction(client, write_commands(writes, announcement))
    appended = replies.pop() if announcement is not None else None
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    if announcement is None:
        return Append.DONE
    return Append.REFUSED if isinstance(appended, Exception) else script_append(appended)
