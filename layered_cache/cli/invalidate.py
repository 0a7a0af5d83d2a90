"""``layered-cache invalidate NAMESPACE field=value ... --config FILE``: delete a key, its
replicas and its lease, and announce it on the backplane so every instance drops its L1
copy: the same path as ``cache.invalidate()``, for an operator who can't wait for the
TTL.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TextIO

import msgspec

from layered_cache._config import Config
from layered_cache._keys import backplane_stream_name, lease_name, replica_names
from layered_cache._l2 import L2Unavailable
from layered_cache._redact import redact
from layered_cache._replicas import delete_phases
from layered_cache.cli.common import (
    CliError,
    load,
    parse_fields,
    policy_of,
    refuse_uncached,
    run,
)
from layered_cache.cli.connect import (
    Masters,
    Session,
    degraded_ok,
    down,
    on_dead,
    same_replica_counts,
    still_working,
)
from layered_cache.cli.reads import KeyReads

__all__ = ["InvalidateReport", "cmd_invalidate"]


class InvalidateReport(msgspec.Struct, frozen=True):
    key: str
    existed: int  # of the key, its replicas and its lease: how many were there to delete


async def _invalidate(config: Config, namespace: str, items: Sequence[str]) -> InvalidateReport:
    async with degraded_ok(config) as (session, masters):
        policy = policy_of(session.cache, namespace)
        fields, key = parse_fields(items, policy)
        await same_replica_counts(session, config)
        _refuse_partial_invalidation(session, config, masters, key, policy.replicas)
        names = [key, *replica_names(key, policy.replicas), lease_name(key)]
        reads = KeyReads(session.store)
        existed = sum([await reads.exists(name) for name in names])
        try:
            await session.cache.invalidate(namespace, fields)
        except L2Unavailable as exc:
            raise CliError(f"invalidation failed: {redact(str(exc))}") from None
        return InvalidateReport(key, existed)


def _refuse_partial_invalidation(
    session: Session, config: Config, masters: Masters, key: str, replicas: int
) -> None:
    """Delete nothing unless every name can be deleted and announced: a half-done
    invalidation (say, replicas left on a master that comes back) would look done."""
    bases, replica_names = delete_phases(key, replicas)
    names = bases + replica_names
    if config.backplane.enabled:
        names.append(backplane_stream_name(config.redis.prefix, config.backplane.stream))
    blocked = on_dead(session, masters, names)
    if blocked:
        where = "; ".join(f"{', '.join(found)} on {node}" for node, found in blocked.items())
        raise CliError(
            f"cannot invalidate {key}: {where}. {down(masters)}; nothing was deleted. "
            f"Retry when it is back or its slots have moved; {still_working(masters)}"
        )


def cmd_invalidate(args: argparse.Namespace, out: TextIO) -> int:
    """Exit 0 once every name is deleted (and announced, with the backplane on)."""
    config = load(args.config)
    refuse_uncached(config, args.namespace, "invalidate")
    report = run(_invalidate(config, args.namespace, args.fields))
    where = "announced on the backplane" if config.backplane.enabled else "backplane disabled"
    out.write(
        f"invalidated {report.key}: {report.existed} name(s) deleted "
        f"(key, replicas, lease); {where}\n"
    )
    return 0
