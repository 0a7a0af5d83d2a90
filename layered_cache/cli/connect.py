"""Opening the cache for a command, and telling what a Redis Cluster with a dead master
still allows.

Every command that touches Redis first checks that something answers (so an unreachable
Redis is one line naming the URL, not a timeout per key) and, in a cluster, pings each
master: single-key commands (``inspect``, ``invalidate``) still work on the live slots,
commands that scan or write everywhere (``hotkeys``, ``warm``) refuse, naming the dead
node and its slots. These are admin commands the store does not have (PING, CLUSTER
INFO, the slot map), so they use the cache's client, which ``make_client`` built.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.crc import key_slot

from layered_cache._cache import LayeredCache
from layered_cache._clients import REDIS_FAILURES
from layered_cache._config import Config
from layered_cache._invalidation import ReplicaCountMismatch, check_replica_counts, replica_counts
from layered_cache._l2 import L2Store
from layered_cache._redact import redact_url
from layered_cache._wiring import build_parts
from layered_cache.cli.common import CliError, why

__all__ = [
    "Masters",
    "connected",
    "degraded_ok",
    "down",
    "key_on_dead_master",
    "on_dead",
    "same_replica_counts",
    "still_working",
]


class Masters(msgspec.Struct, frozen=True):
    """A cluster's masters as the CLI found them: the dead ones ("host:port" -> why, as
    the PING to that node failed) and the live ones. Always empty off a cluster."""

    dead: dict[str, str] = msgspec.field(default_factory=dict)
    live: list[str] = msgspec.field(default_factory=list)
    slots: dict[str, str] = msgspec.field(default_factory=dict)  # dead node -> "0-5460"


@dataclass(frozen=True, slots=True)
class Session:
    """What a command works with: the cache (for ``invalidate``, ``set`` and the
    namespaces' policies) and its L2 store (reads through the circuit breaker)."""

    cache: LayeredCache
    store: L2Store


async def _reach(session: Session, config: Config) -> None:
    """Raise a ``CliError`` naming the configured URL if no Redis answers at all.

    A cluster client only needs one seed to learn the slot map; a dead master is found
    (and named) by ``_masters`` afterwards, not reported as the seed's failure."""
    client: Any = session.store.client
    first = client.initialize() if config.redis.cluster else client.ping()
    try:
        await asyncio.wait_for(first, config.redis.connect_timeout + 2.0)
    except Exception as exc:  # connection refused, auth, TLS, DNS, cluster init...
        url = redact_url(config.redis.url)
        raise CliError(f"cannot reach Redis at {url}: {why(exc)}") from None


async def _masters(session: Session, config: Config) -> Masters:
    """PING every master of the slot map, each on its own connection, concurrently."""
    if not config.redis.cluster:
        return Masters()
    client: Any = session.store.client
    nodes = client.get_primaries()
    limit = config.redis.connect_timeout + config.redis.timeout

    async def ping(node: Any) -> str | None:
        try:
            await asyncio.wait_for(node.execute_command("PING"), limit)
        except Exception as exc:  # refused, timeout, LOADING, ...
            return why(exc)
        return None

    results = await asyncio.gather(*(ping(node) for node in nodes))
    pairs = list(zip(nodes, results, strict=True))
    dead = {node.name: reason for node, reason in pairs if reason is not None}
    live = [node for node, reason in pairs if reason is None]
    masters = Masters(dead, [n.name for n in live], {n: _slot_ranges(client, n) for n in dead})
    if dead and live and await _cluster_failed(live[0], limit):
        raise CliError(
            f"{down(masters)}, and the cluster refuses every key (cluster_state:fail, as "
            "cluster-require-full-coverage yes, the Redis default, makes it): nothing works "
            "until the master is back or its slots are reassigned. Cache clusters should run "
            "with `no` (docs/operations.md)"
        )
    return masters


async def _cluster_failed(node: Any, limit: float) -> bool:
    """Whether ``node`` says the cluster is down as a whole (CLUSTER INFO)."""
    try:
        info: Any = await asyncio.wait_for(node.execute_command("CLUSTER INFO"), limit)
    except Exception:  # it answered PING a moment ago; let the command itself fail
        return False
    if isinstance(info, dict):
        return str(info.get("cluster_state", "")) == "fail"
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:fail" in text


def _slot_ranges(client: Any, node: str) -> str:
    """The slots ``node`` owns per the client's slot map, as ``"0-5460, 5470"``."""
    owned = sorted(slot for slot, nodes in client.nodes_manager.slots_cache.items()
                   if nodes and nodes[0].name == node)  # fmt: skip
    ranges: list[list[int]] = []
    for slot in owned:
        if ranges and ranges[-1][1] == slot - 1:
            ranges[-1][1] = slot
        else:
            ranges.append([slot, slot])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges) or "none"


def _owner(session: Session, name: str) -> str:
    """The master ("host:port") whose slot holds ``name``, per the client's slot map."""
    client: Any = session.store.client
    return str(client.nodes_manager.slots_cache[key_slot(name.encode())][0].name)


def down(masters: Masters) -> str:
    """'master 127.0.0.1:7001 is down (why; slots 5461-10922)', for one or more."""
    parts = [f"{name} ({reason}; slots {masters.slots[name]})"
             for name, reason in masters.dead.items()]  # fmt: skip
    noun = "master" if len(parts) == 1 else "masters"
    verb = "is" if len(parts) == 1 else "are"
    return f"Redis Cluster {noun} {', '.join(parts)} {verb} down"


def still_working(masters: Masters) -> str:
    """What an operator can still do with a master down (part of every such error)."""
    return (
        f"still working: `inspect` and `invalidate` of keys whose slots are on the live "
        f"masters ({', '.join(masters.live)}), with cluster-require-full-coverage no "
        "(docs/operations.md)"
    )


def on_dead(session: Session, masters: Masters, names: Sequence[str]) -> dict[str, list[str]]:
    """Of ``names``, those whose slot is on a dead master, by master."""
    found: dict[str, list[str]] = {}
    if masters.dead:
        for name in names:
            owner = _owner(session, name)
            if owner in masters.dead:
                found.setdefault(owner, []).append(name)
    return found


def key_on_dead_master(key: str, owner: str, masters: Masters) -> CliError:
    """The error for a single-key command whose key lives on a dead master."""
    return CliError(
        f"{key} is in slot {key_slot(key.encode())}, on master {owner}. "
        f"{down(masters)}; {still_working(masters)}"
    )


@contextlib.asynccontextmanager
async def degraded_ok(config: Config) -> AsyncIterator[tuple[Session, Masters]]:
    """A cache that answered, with the dead cluster masters if any (its backplane
    listener is never started: a CLI needs none). For single-key commands, which work
    on live slots."""
    parts = build_parts(config)
    session = Session(LayeredCache(config, parts), parts.store)
    try:
        await _reach(session, config)
        masters = await _masters(session, config)
        if masters.dead and not masters.live:
            raise CliError(f"{down(masters)}: no master answers")
        yield session, masters
    finally:
        await session.cache.close()


@contextlib.asynccontextmanager
async def connected(config: Config, command: str) -> AsyncIterator[Session]:
    """A cache whose Redis answered, every cluster master included: ``command`` needs
    them all (it scans or writes keys anywhere)."""
    async with degraded_ok(config) as (session, masters):
        if masters.dead:
            raise CliError(
                f"{down(masters)}: `{command}` needs every master; {still_working(masters)}"
            )
        yield session


async def same_replica_counts(session: Session, config: Config) -> None:
    """A command that deletes or writes keys must delete and write the replicas the
    fleet has (``hot.replicas``, recorded in Redis by every instance and the daemon): with
    another count it left replicas that hot instances kept serving after it reported the
    key invalidated. Refused, as an instance or the daemon refuses to start."""
    counts = replica_counts(config)
    try:
        await check_replica_counts(session.store.client, config.redis.prefix, counts)
    except ReplicaCountMismatch as exc:
        raise CliError(str(exc)) from None
    except REDIS_FAILURES:
        # The record's master is down (its slot): unchecked, as an instance starts then;
        # the command itself says what it can't reach.
        return
