"""``layered-cache inspect NAMESPACE field=value ... --config FILE [--json]``: one key as
Redis holds it: the base key's PTTL, size and envelope metadata, which hot-key replicas
exist, and who holds the fill lease.

It answers "why does the service return this?" without reading the value itself: the
envelope's timestamps say whether the value is fresh, stale (served only by the
fail-safe) or past its hard expiry. With a cluster master down it still shows keys on
the live masters, listing replicas on the dead one as unknown.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Sequence
from typing import TextIO

import msgspec

from layered_cache._codec import MAX_TAGS, CodecError, decode_meta
from layered_cache._config import Config
from layered_cache._keys import lease_name, replica_names
from layered_cache.cli.common import (
    format_ms,
    iso,
    load,
    parse_fields,
    policy_of,
    print_json,
    printable,
    refuse_uncached,
    relative,
    run,
)
from layered_cache.cli.connect import degraded_ok, key_on_dead_master, on_dead
from layered_cache.cli.reads import KeyReads, OverReadCap

__all__ = [
    "BaseReport",
    "EnvelopeError",
    "EnvelopeReport",
    "InspectReport",
    "LeaseReport",
    "ReplicaReport",
    "cmd_inspect",
]


class EnvelopeReport(msgspec.Struct, frozen=True):
    """The L2 envelope's metadata; times both absolute (ISO, UTC) and relative to now."""

    format: int
    written_at: str
    age_s: float
    soft_expiry: str
    soft_expiry_in_s: float
    fresh: bool
    delta_s: float  # the measured load time, XFetch's delta
    value_size: int


class EnvelopeError(msgspec.Struct, frozen=True):
    """The base key holds bytes that are no layered_cache envelope."""

    error: str


class BaseReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """The base key. ``size`` and ``envelope`` only when it exists (omitted otherwise)."""

    exists: bool
    pttl_ms: int
    size: int | None = None
    envelope: EnvelopeReport | EnvelopeError | None = None


class ReplicaReport(msgspec.Struct, frozen=True):
    name: str
    pttl_ms: int


class LeaseReport(msgspec.Struct, frozen=True):
    """The fill lease; ``holder`` and ``pttl_ms`` are null while it is free."""

    name: str
    holder: str | None
    pttl_ms: int | None


class InspectReport(msgspec.Struct, frozen=True):
    namespace: str
    template: str
    key: str
    base: BaseReport
    replicas_configured: int
    replicas: list[ReplicaReport]  # only those that exist
    replicas_unreachable: dict[str, list[str]]  # dead master -> replica names on it
    lease: LeaseReport


def _why(data: bytes, exc: CodecError) -> str:
    """The decoder's complaint, or, for an envelope whose only fault is its number of
    tags (written before the limit, or planted), that number."""
    with contextlib.suppress(msgspec.DecodeError, RecursionError):
        fields = msgspec.msgpack.decode(data)
        tags = fields[5] if isinstance(fields, list) and len(fields) == 6 else None
        if isinstance(tags, dict) and len(tags) > MAX_TAGS:
            return f"{len(tags):,} tags, more than the {MAX_TAGS:,} an entry may carry"
    return str(exc)


def _envelope(data: bytes, now: float) -> EnvelopeReport | EnvelopeError:
    try:
        meta = decode_meta(data)
    except CodecError as exc:
        return EnvelopeError(f"not a layered_cache envelope: {_why(data, exc)}")
    return EnvelopeReport(
        format=meta.format,
        written_at=iso(meta.written_at),
        age_s=round(now - meta.written_at, 3),
        soft_expiry=iso(meta.soft_expiry),
        soft_expiry_in_s=round(meta.soft_expiry - now, 3),
        fresh=now < meta.soft_expiry,
        delta_s=meta.delta,
        value_size=len(meta.value),
    )


async def _base(reads: KeyReads, key: str) -> BaseReport:
    now = time.time()
    try:
        data = await reads.get(key)
    except OverReadCap as exc:  # a foreign value: no writer of ours exceeds the cap
        why = f"not a layered_cache envelope: {exc.size:,} bytes, over what a read takes"
        return BaseReport(True, await reads.pttl(key), exc.size, EnvelopeError(why))
    pttl = await reads.pttl(key)
    if data is None:
        return BaseReport(exists=False, pttl_ms=pttl)
    return BaseReport(True, pttl, len(data), _envelope(data, now))


async def _replicas(
    reads: KeyReads, names: Sequence[str], skipped: set[str]
) -> list[ReplicaReport]:
    """The replicas that exist, except those on a dead master (unknown, not absent)."""
    found: list[ReplicaReport] = []
    for name in names:
        if name in skipped:
            continue
        pttl = await reads.pttl(name)
        if pttl != -2:
            found.append(ReplicaReport(name, pttl))
    return found


async def _lease(reads: KeyReads, key: str) -> LeaseReport:
    lease = lease_name(key)
    try:
        holder = await reads.get(lease)
    except OverReadCap as exc:  # planted: our holders are short tokens
        foreign = f"<{exc.size:,} bytes, not a lease token>"
        return LeaseReport(lease, foreign, await reads.pttl(lease))
    if holder is None:
        return LeaseReport(lease, None, None)
    return LeaseReport(lease, holder.decode(errors="replace"), await reads.pttl(lease))


async def _inspect(config: Config, namespace: str, items: Sequence[str]) -> InspectReport:
    async with degraded_ok(config) as (session, masters):
        policy = policy_of(session.cache, namespace)
        _, key = parse_fields(items, policy)
        for owner in on_dead(session, masters, [key]):  # its lease shares the slot
            raise key_on_dead_master(key, owner, masters)
        names = replica_names(key, policy.replicas)
        unreachable = on_dead(session, masters, names)
        skipped = {name for found in unreachable.values() for name in found}
        reads = KeyReads(session.store)
        return InspectReport(
            namespace=namespace,
            template=policy.template.template,
            key=key,
            base=await _base(reads, key),
            replicas_configured=policy.replicas,
            replicas=await _replicas(reads, names, skipped),
            replicas_unreachable=unreachable,
            lease=await _lease(reads, key),
        )


def _write_base(base: BaseReport, out: TextIO) -> None:
    if not base.exists:
        out.write("L2         absent\n")
        return
    out.write(f"L2         present, {base.size} bytes, PTTL {format_ms(base.pttl_ms)}\n")
    env = base.envelope
    if isinstance(env, EnvelopeError):
        out.write(f"envelope   {printable(env.error)}\n")
    elif env is not None:
        state = "fresh" if env.fresh else "stale (served only by the fail-safe)"
        out.write(f"written_at {env.written_at} ({relative(-env.age_s)})\n")
        out.write(f"soft_exp   {env.soft_expiry} ({relative(env.soft_expiry_in_s)}): {state}\n")
        out.write(f"delta      {env.delta_s:.4f}s (measured load time, XFetch)\n")
        out.write(f"size       {env.value_size} bytes of value\n")


def _write_replicas(report: InspectReport, out: TextIO) -> None:
    configured = report.replicas_configured
    if not configured:
        out.write("replicas   none (namespace has no hot-key replicas)\n")
        return
    present = ", ".join(
        f"#{r.name.rsplit('#', 1)[1]} ({format_ms(r.pttl_ms)})" for r in report.replicas
    )
    out.write(
        f"replicas   {len(report.replicas)}/{configured} exist"
        + (f": {present}" if present else "")
        + "\n"
    )
    for node, names in report.replicas_unreachable.items():
        shards = ", #".join(name.rsplit("#", 1)[1] for name in names)
        out.write(f"           unknown: #{shards} (on master {node}, which is down)\n")


def _write_lease(lease: LeaseReport, out: TextIO) -> None:
    if lease.holder is None or lease.pttl_ms is None:
        out.write(f"lease      {lease.name}: free\n")
    else:
        out.write(
            f"lease      {lease.name}: held by token {printable(lease.holder)} "
            f"(PTTL {format_ms(lease.pttl_ms)})\n"
        )


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    """Read-only: nothing in Redis changes, whatever the key's state."""
    config = load(args.config)
    refuse_uncached(config, args.namespace, "inspect")
    report = run(_inspect(config, args.namespace, args.fields))
    if args.json:
        print_json(report, out)
        return 0
    out.write(f"namespace  {report.namespace} (template {report.template})\n")
    out.write(f"key        {report.key}\n")
    _write_base(report.base, out)
    _write_replicas(report, out)
    _write_lease(report.lease, out)
    return 0
