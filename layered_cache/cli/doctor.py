"""``layered-cache doctor --config FILE [--json]``: what a full Redis would do to the
cache, per master: ``maxmemory-policy``, ``maxmemory`` and its consequence, and the
config's tagged namespaces that may serve a stale value under it (the same texts the
cache logs at start, ``_memory_policy``). Read-only."""

from __future__ import annotations

import argparse
from typing import TextIO

import msgspec

from layered_cache._config import Config
from layered_cache._memory_policy import MemoryPolicy, read_memory_policies, tagged_namespaces
from layered_cache.cli.common import load, print_json, run
from layered_cache.cli.connect import degraded_ok, down

__all__ = ["DoctorReport", "cmd_doctor"]


class DoctorReport(msgspec.Struct, frozen=True):
    memory: list[MemoryPolicy]  # one per master (one for a single Redis)
    consequences: dict[str, str]  # node ("" = the single Redis) -> what a full Redis does
    down: str | None  # the dead cluster masters, if any
    tagged_risks: dict[str, str] = {}  # node -> the stale-value risk of tagged namespaces


async def _doctor(config: Config) -> DoctorReport:
    async with degraded_ok(config) as (session, masters):
        found = await read_memory_policies(session.store.client)
        live = [policy for policy in found if policy.node not in masters.dead]
        texts = {p.node: p.consequence for p in live if p.consequence is not None}
        tagged = tagged_namespaces(config)
        risks = {p.node: risk for p in live if (risk := p.tagged_risk(tagged))}
        return DoctorReport(live, texts, down(masters) if masters.dead else None, risks)


def _limit(maxmemory: int | None) -> str:
    if maxmemory is None:
        return "unknown"
    return "none (0)" if maxmemory == 0 else f"{maxmemory / 2**20:.1f} MiB"


def cmd_doctor(args: argparse.Namespace, out: TextIO) -> int:
    config = load(args.config)
    report = run(_doctor(config))
    if args.json:
        print_json(report, out)
        return 0
    if report.down is not None:
        out.write(f"{report.down}\n")
    for policy in report.memory:
        where = policy.node or "redis"
        if policy.error is not None:
            out.write(f"{where}: maxmemory-policy unknown (CONFIG GET refused: {policy.error})\n")
            continue
        out.write(
            f"{where}: maxmemory-policy {policy.policy}, maxmemory {_limit(policy.maxmemory)}\n"
        )
        text = report.consequences.get(policy.node)
        out.write(f"  {text}\n" if text else "  nothing to warn about\n")
        if risk := report.tagged_risks.get(policy.node):
            out.write(f"  {risk}\n")
    return 0
