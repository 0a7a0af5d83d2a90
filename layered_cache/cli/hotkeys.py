"""``layered-cache hotkeys --config FILE [--json]``: per namespace with hot-key replicas,
the static hot keys of the config with the replicas that exist in Redis, and the keys
the running instances detect as hot.

Detection lives in each instance's memory; the instances report it to fleet hashes in
Redis (``hotreport.py``), which this command sums. Reading those hashes needs SCAN and
HGETALL, which the store does not have: ``fleet_hot_keys`` uses the cache's client.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TextIO

import msgspec

from layered_cache._config import Config, HotConfig
from layered_cache._hotreport import fleet_hot_keys
from layered_cache._keys import replica_names
from layered_cache._policy import Policy
from layered_cache.cli.common import load, print_json, printable, run
from layered_cache.cli.connect import Session, connected
from layered_cache.cli.reads import KeyReads

__all__ = ["DetectedHotKey", "HotKeysReport", "NamespaceHotKeys", "StaticHotKey", "cmd_hotkeys"]


class StaticHotKey(msgspec.Struct, frozen=True):
    """A key of ``hot.keys``: whether its base and which replica indexes exist."""

    key: str
    base_exists: bool
    replicas_present: list[int]


class DetectedHotKey(msgspec.Struct, frozen=True):
    """A key the running instances detect as hot, its rate summed over them."""

    key: str
    rate: float  # L2 reads/s, rounded to 0.1
    instances: int  # how many instances report it


class NamespaceHotKeys(msgspec.Struct, frozen=True):
    replicas: int
    threshold: str | None  # "200/s", or None: no live detection
    static: list[StaticHotKey]
    detected: list[DetectedHotKey]


HotKeysReport = dict[str, NamespaceHotKeys]  # namespace -> its hot keys, in config order


async def _static(reads: KeyReads, policy: Policy, keys: Iterable[str]) -> list[StaticHotKey]:
    found: list[StaticHotKey] = []
    for static in sorted(keys):
        present = [
            index
            for index, replica in enumerate(replica_names(static, policy.replicas))
            if await reads.exists(replica)
        ]
        found.append(StaticHotKey(static, await reads.exists(static), present))
    return found


async def _detected(session: Session, config: Config) -> dict[str, list[DetectedHotKey]]:
    """namespace -> its detected keys, hottest first (see hotreport.py)."""
    fleet = await fleet_hot_keys(session.store.client, config.redis.prefix)
    return {
        name: [
            DetectedHotKey(key, round(entry["rate"], 1), int(entry["instances"]))
            for key, entry in sorted(detected.items(), key=lambda kv: -kv[1]["rate"])
        ]
        for name, detected in fleet.items()
    }


async def _hotkeys(config: Config) -> HotKeysReport:
    async with connected(config, "hotkeys") as session:
        reads = KeyReads(session.store)
        report: HotKeysReport = {}
        for name, ns in config.namespaces.items():
            policy = session.cache.namespace(name).policy
            hot = HotConfig() if ns.hot is True else ns.hot
            if hot is False or policy.hot is None:
                continue
            threshold = f"{hot.threshold:g}/s" if hot.threshold is not None else None
            static = await _static(reads, policy, policy.hot.static)
            report[name] = NamespaceHotKeys(policy.replicas, threshold, static, [])
        for name, detected in (await _detected(session, config)).items():
            if name in report:
                static_keys = {entry.key for entry in report[name].static}
                # Instances report their static keys with the detected ones; list
                # those once, as static.
                detected = [hot for hot in detected if hot.key not in static_keys]
                report[name] = msgspec.structs.replace(report[name], detected=detected)
        return report


def cmd_hotkeys(args: argparse.Namespace, out: TextIO) -> int:
    """Read-only; needs every cluster master (the fleet hashes may be on any)."""
    config = load(args.config)
    report = run(_hotkeys(config))
    if args.json:
        print_json(report, out)
        return 0
    if not report:
        out.write("no namespace has hot-key replicas configured\n")
    for name, info in report.items():
        detection = f"detection above {info.threshold}" if info.threshold else "no detection"
        out.write(f"[{name}] replicas={info.replicas}, {detection}\n")
        if not info.static and not info.detected:
            out.write("  no static or detected hot keys\n")
        for static in info.static:
            present = static.replicas_present
            out.write(
                f"  {static.key}: base {'present' if static.base_exists else 'absent'}, "
                f"replicas {len(present)}/{info.replicas}"
                + (f" (#{', #'.join(map(str, present))})" if present else "")
                + "\n"
            )
        for hot in info.detected:
            out.write(
                f"  {printable(hot.key)}: detected hot, {hot.rate:g} L2 reads/s "
                f"(reported by {hot.instances} instance(s))\n"
            )
    out.write(
        "\nDetected keys come from the running instances (each reports its own detection "
        "about once a second); static keys come from the config.\n"
    )
    return 0
