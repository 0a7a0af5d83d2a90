"""Invalidation: delete a key everywhere it may live, then tell every instance.

For each key: the base key, every replica name the namespace may have written (whether
or not this process thinks the key is hot: another instance may have), the lease (so an
in-flight fill that read the database before this invalidation can no longer write: its
compare-and-write sees a missing lease) and each replica's own lease ``{key#i}:lease``.
Only then are the keys appended to the backplane stream: an instance that drops its L1
copy on that message can only refill from the new L2 state. If the stream refuses
the append (a full Redis under noeviction answers OOM to XADD but not to DEL or
PUBLISH), the announcement goes over its pub/sub fallback channel (``_fallback``).

Replicas are deleted in two phases, base first (why: ``_replicas.py``). Each phase is
one pipelined round trip per node (in a cluster: one DEL per name, the leases first:
``L2Store.delete``); on a single node both phases are one atomic DEL.

Idempotent: deleting missing names is harmless, so at-least-once delivery is fine.

Replica counts must agree: a process that invalidates with fewer replicas than another
writes leaves replicas behind that nothing ever deletes. So every cache instance and the
daemon record each namespace's count in one Redis hash at start (the first one wins)
and refuse to start when theirs differs, recording nothing (``check_replica_counts``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ExecAbortError, NoPermissionError, OutOfMemoryError

from layered_cache._backplane import Announcement, BackplanePublisher
from layered_cache._clients import REDIS_FAILURES, RedisClient
from layered_cache._config import Config
from layered_cache._fallback import FallbackChannel, fallback_channel
from layered_cache._keys import replica_record_name
from layered_cache._l2 import L2Store
from layered_cache._policy import Policy, compile_policy
from layered_cache._replicas import delete_name_phases
from layered_cache._scripts import RECORD_COUNTS_SCRIPT
from layered_cache._templates import parse_template

__all__ = [
    "Invalidator",
    "ReplicaCountMismatch",
    "check_replica_counts",
    "recorded_counts",
    "replica_counts",
]


class ReplicaCountMismatch(ValueError):
    """This process's ``hot.replicas`` differs from the count its fleet recorded."""


# Record fields naming a key template, or its shape, rather than a namespace.
_TEMPLATE_FIELD = "template:"
_SHAPE_FIELD = "shape:"


def replica_counts(config: Config) -> dict[str, int]:
    """Record field -> hot.replicas (0 without a hot section) of every namespace with L2,
    under its key template's shape (``shape:book:{}``), its template
    (``template:book:{id}``) and its name. The shape, the template with its placeholder
    names erased, is what names the keys and their replicas: a namespace renamed in a
    rolling deploy, placeholders included (``book:{book_id}``), keeps it, and stays
    checked against the instances still running the old names. The template and the
    name are what earlier versions recorded: still written, so that a process of such a
    version starting beside this one is checked against it too."""
    prefix = config.redis.prefix
    return recorded_counts(compile_policy(n, ns, prefix) for n, ns in config.namespaces.items())


def recorded_counts(policies: Iterable[Policy]) -> dict[str, int]:
    """``replica_counts`` of compiled policies (a running cache's)."""
    counts: dict[str, int] = {}
    for policy in policies:
        if policy.l2:
            counts[_SHAPE_FIELD + _shape(policy.name, policy.template.template)] = policy.replicas
            counts[_TEMPLATE_FIELD + policy.template.template] = policy.replicas
            counts[policy.name] = policy.replicas
    return counts


def _shape(namespace: str, template: str) -> str:
    """``book:{id}`` -> ``book:{}``: the names a template builds depend on its literal
    text and where its placeholders are, not on what the placeholders are called."""
    literals, _ = parse_template(namespace, template)
    return "{}".join(literals)


async def _by_plain_commands(
    client: RedisClient, name: str, counts: Mapping[str, int], record: bool
) -> dict[str, str]:
    """``RECORD_COUNTS_SCRIPT``'s work in plain commands, not in one step: the recorded
    counts that differ from ``counts``; with ``record`` and none, the missing ones
    recorded (HSETNX: the first process wins), then those another process recorded
    first compared (racing through here, both were let in with different counts). A
    record of another type is deleted first, as the script does; a user that may not
    write hashes compares only."""
    with contextlib.suppress(NoPermissionError):  # may not: HMGET says WRONGTYPE then
        if _text(await client.type(name)) not in ("hash", "none"):
            await client.delete(name)
    wrong = await _differing(client, name, counts)
    if not record or wrong:
        return wrong
    # One MULTI/EXEC on one node (a cluster's pipeline can't be one: the record is one
    # key, one node, all the same): two processes' HSETNX can't interleave, one wins.
    pipe = client.pipeline(transaction=not isinstance(client, RedisCluster))
    for field, count in counts.items():
        pipe.hsetnx(name, field, count)
    try:
        added = await pipe.execute()
    except (NoPermissionError, ExecAbortError):  # may not write hashes (or MULTI)
        return wrong
    return wrong if all(added) else await _differing(client, name, counts)


async def _differing(client: RedisClient, name: str, counts: Mapping[str, int]) -> dict[str, str]:
    seen = await client.hmget(name, list(counts))
    return {
        field: _text(value)
        for field, value in zip(counts, seen, strict=True)
        if value is not None and _text(value) != str(counts[field])
    }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _what(field: str) -> str:
    if field.startswith(_SHAPE_FIELD):
        shape = field.removeprefix(_SHAPE_FIELD)
        return f"key template shape {shape!r} (any placeholder names)"
    if field.startswith(_TEMPLATE_FIELD):
        return f"key template {field.removeprefix(_TEMPLATE_FIELD)!r}"
    return f"namespace {field!r}"


async def check_replica_counts(client: RedisClient, prefix: str, counts: Mapping[str, int]) -> None:
    """Compare ``counts`` (``replica_counts``: hot.replicas, 0 without hot keys, by key
    template shape, key template and namespace) with the recorded ones and record those
    not recorded yet, in one step (``RECORD_COUNTS_SCRIPT``): raises
    ``ReplicaCountMismatch`` naming every shape, template and namespace whose recorded
    count differs, having recorded none. Raises Redis errors (the caller decides)."""
    if not counts:
        return
    name = replica_record_name(prefix)
    args = [part for field, count in counts.items() for part in (field, str(count))]
    record = client.register_script(RECORD_COUNTS_SCRIPT)  # EVALSHA, as every script
    try:
        found: list[Any] = await record(keys=[name], args=args)
        recorded = {_text(found[i]): _text(found[i + 1]) for i in range(0, len(found), 2)}
    except (OutOfMemoryError, NoPermissionError) as exc:
        # Full under noeviction (a missing field can't be written), or a user that may
        # not run scripts (the daemon needs none otherwise): the same with plain
        # commands, not in one step. Refusing here stalled the daemon, whose check runs
        # before its first delete, and deletes work on a full Redis.
        writable = isinstance(exc, NoPermissionError)
        recorded = await _by_plain_commands(client, name, counts, writable)
    wrong = [
        f"{_what(field)}: hot.replicas = {count} here, {recorded[field]} recorded"
        for field, count in counts.items()
        if field in recorded
    ]
    if wrong:
        raise ReplicaCountMismatch(
            "; ".join(wrong)
            + f" in {name} by the processes sharing this Redis and prefix. Every cache"
            " instance and the daemon must use the same count (0 = no hot section), or"
            " invalidations leave replicas behind. To change it, see docs/hotkeys.md"
            ' ("Changing hot.replicas").'
        )


class Invalidator:
    """Deletes L2 names, then announces the keys: on the stream, or over pub/sub when
    the stream refuses the append (``_fallback``: a Redis full under ``noeviction``)."""

    def __init__(self, l2: L2Store, backplane: BackplanePublisher | None) -> None:
        self._l2 = l2
        self._backplane = backplane
        self.fallback: FallbackChannel | None = None
        if backplane is not None:
            self.fallback = FallbackChannel(
                backplane.client, fallback_channel(backplane.stream), backplane.origin
            )

    @property
    def fallback_deliveries(self) -> int:
        """Announcements the stream refused that went over pub/sub instead."""
        return self.fallback.deliveries if self.fallback is not None else 0

    async def invalidate(self, targets: Iterable[tuple[str, int]]) -> int:
        """``targets``: (full key, replica count). Returns how many names existed.

        Raises ``L2Unavailable`` or a Redis error when Redis fails: the caller retries
        (nothing is reported done before the keys are gone).
        """
        keys, phase1, phase2 = delete_name_phases(targets)
        if not keys:
            return 0
        deleted = await self._l2.delete_in_order([phase1, phase2] if phase2 else [phase1])
        await self.announce(keys)
        return deleted

    async def announce_tags(self, versions: Mapping[str, str]) -> bool:
        """Tell every instance the new versions of invalidated tags. Returns whether
        the announcement went over pub/sub (degraded) rather than the stream."""
        if self._backplane is None or not versions:
            return False
        return await self._announce([], versions)

    def announcement_with_writes(self, keys: Sequence[str]) -> Announcement | None:
        """On a single node: the stream entry for ``keys``, which ``set()`` appends in
        the same atomic step as its SETs (one round trip, and still after them). None
        in a cluster (the stream's slot is not the keys') or without a backplane:
        ``announce`` afterwards, as ``invalidate`` does."""
        backplane = self._backplane
        if backplane is None or self._l2.cluster or not keys:
            return None
        return backplane.announcement(keys)

    def published_by_write(self, keys: Sequence[str]) -> None:
        """A ``set()`` whose append the stream refused published it on the fallback
        channel in its own atomic step (``WRITE_ONE_SCRIPT``): counted as ours."""
        if self.fallback is not None:
            self.fallback.delivered(len(keys), 0, "the stream refused set()'s append")

    async def announce(self, keys: Sequence[str]) -> bool:
        """Tell every instance to drop ``keys`` from L1. Returns whether it went over
        pub/sub (degraded); raises the Redis error only when neither the stream nor
        pub/sub took it (no instance could be told)."""
        if self._backplane is None or not keys:
            return False
        return await self._announce(keys, None)

    async def _announce(self, keys: Sequence[str], tags: Mapping[str, str] | None) -> bool:
        """Under the breaker of the stream's node and the store's concurrency bound, as
        every L2 operation (``L2Store.guard``): an open breaker refuses at once
        (``L2Unavailable``), a timeout counts as its failure. Without it, a ``set()`` of
        an ``l2 = false`` namespace (its only Redis step is this) paid the XADD's and the
        PUBLISH's timeouts on every call of an outage."""
        assert self._backplane is not None
        degraded: bool = await self._l2.guard(self._publish(keys, tags), self._backplane.stream)
        return degraded

    async def _publish(self, keys: Sequence[str], tags: Mapping[str, str] | None) -> bool:
        """The stream append, else pub/sub: whether pub/sub carried it (degraded)."""
        assert self._backplane is not None and self.fallback is not None
        try:
            await self._backplane.publish(keys, tags=tags)
            return False
        except REDIS_FAILURES as exc:
            # Refused (OOM under noeviction, a WRONGTYPE name, ...) after the L2
            # names are gone: PUBLISH needs no memory. If it fails too, the
            # stream's error is what the caller sees.
            try:
                await self.fallback.deliver(keys, tags, exc)
            except REDIS_FAILURES:
                raise exc from None
            return True
