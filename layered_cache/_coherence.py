"""Coherence: an invalidation deletes from L2 first, then every instance drops its L1
copies: this one at once, the others through the backplane (``_backplane``), whose
callbacks land here too. Keys and tags alike; a fill that read L2 before the delete may
land while it runs, so the local drop happens before and again after.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from layered_cache._clients import REDIS_FAILURES
from layered_cache._invalidation import ReplicaCountMismatch, check_replica_counts, recorded_counts
from layered_cache._keys import validate_tag
from layered_cache._l2 import L2Unavailable
from layered_cache._namespace import Namespace
from layered_cache._runtime import Runtime

__all__ = ["Coherence"]

_log = structlog.get_logger("layered_cache")


class Coherence:
    def __init__(self, namespaces: list[Namespace], runtime: Runtime) -> None:
        self._namespaces = namespaces
        self._rt = runtime

    async def invalidate(self, ns: Namespace, fields: Mapping[str, object]) -> None:
        """Delete, announce, drop again. The Redis steps run to completion even if our
        caller is cancelled (``BackgroundTasks.to_completion``): a DEL without its
        announcement would leave other instances serving the old value for their L1
        TTL (on a single node the two are two round trips; ``set()`` has one)."""
        key = ns.key(fields)
        self._rt.check_open()
        ns.policy.stats.invalidated += 1
        self.forget([key])  # also detaches loads: new callers must not join them
        try:
            await self._rt.tasks.to_completion(self._delete([(key, ns.policy.replicas)]))
        except REDIS_FAILURES as exc:
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _delete(self, targets: list[tuple[str, int]]) -> None:
        try:
            await self._rt.invalidator.invalidate(targets)
        finally:
            # Again: a read that filled L1 from L2 before the DEL landed may have landed
            # its copy. Also when the DEL or its announcement failed: the DEL may have
            # landed, and the copy (a read's of this instance, since the first drop)
            # would outlive it here for its L1 TTL.
            self.forget([key for key, _ in targets])
            # HTTP caches last, in the background, when the delete is done (or failed:
            # it may have landed). Here, not in our caller: a caller cancelled while the
            # DEL is on its way leaves this running, and a purge sent then let the
            # gateway refetch the old value from L2 and keep it for s-maxage.
            self._rt.purges.submit([key for key, _ in targets])

    async def invalidate_tag(self, tag: str) -> None:
        """A new version for the tag, the tagged loads in flight revoked, then the
        backplane (``_tags``); to completion, as ``invalidate``: a new version that
        nobody announced leaves every instance that remembers the old one serving
        the dead entries from L2, until their TTL."""
        validate_tag(tag)  # before anything: a refused tag must not reach a gateway's BAN
        self._rt.check_open()
        self._forget_tag(tag)
        try:
            await self._rt.tasks.to_completion(self._new_version(tag))
        except REDIS_FAILURES as exc:
            raise L2Unavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _new_version(self, tag: str) -> None:
        try:
            version = await self._rt.versions.invalidate(tag)
            await self._rt.invalidator.announce_tags({tag: version})
        finally:
            # Again, as ``_delete``'s, also when the announcement failed: a read here
            # between the first drop and the new version's SET filled L1 with an entry
            # that version kills ("local copies are dropped regardless").
            self._forget_tag(tag)
            self._rt.purges.submit(tags=[tag])  # when done, as ``_delete``'s

    def forget(self, keys: list[str]) -> None:
        """An invalidation (local, or from the backplane: the daemon or another
        instance): every namespace drops the keys from L1 and detaches their loads."""
        for ns in self._namespaces:
            ns._forget(keys)

    def apply_remote(self, keys: list[str]) -> None:
        """A backplane entry: the daemon or another instance invalidated ``keys``."""
        for ns in self._namespaces:
            ns.policy.stats.backplane_l1_dropped += ns._forget(keys)

    def apply_tags(self, versions: dict[str, str]) -> None:
        """New tag versions from the backplane (another instance, or the daemon)."""
        self._rt.versions.apply(versions)
        for tag in versions:
            for ns in self._namespaces:
                ns.policy.stats.backplane_l1_dropped += ns._forget_tag(tag)

    def forget_all(self) -> None:
        """This instance fell behind the backplane's retention: nothing in L1, no tag
        version it remembers, is known to be current."""
        self._rt.flight.forget_all()
        self._rt.versions.forget_all()
        for ns in self._namespaces:
            ns.policy.marks.clear()  # L1, or without it the tombstones

    def lost_track(self) -> None:
        """The backplane listener found a gap (``on_gap``): ``forget_all``; and since a
        gap may mean Redis lost its data (a restart without persistence, FLUSHALL, a
        failover to an empty node), this instance's replica counts are recorded again
        (``_invalidation.check_replica_counts``). The record was written only at start:
        after such a loss, a process starting with another ``hot.replicas`` recorded its
        own and started, and its invalidations left the replicas it doesn't know of."""
        self.forget_all()
        self._rt.tasks.spawn(self._record_replica_counts())

    async def _record_replica_counts(self) -> None:
        counts = recorded_counts(ns.policy for ns in self._namespaces)
        try:
            await check_replica_counts(self._rt.store.client, self._rt.prefix, counts)
        except ReplicaCountMismatch as exc:  # one started in the moment before: say so
            _log.error(
                "replica_count_mismatch_at_runtime",
                error=str(exc),
                fix="give every process the same hot.replicas (docs/hotkeys.md)",
            )
        except REDIS_FAILURES:
            pass  # the next gap tries again

    def _forget_tag(self, tag: str) -> None:
        for ns in self._namespaces:
            ns._forget_tag(tag)
