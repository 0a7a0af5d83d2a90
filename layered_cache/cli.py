"""``layered-cache`` (also ``python -m layered_cache``): look inside and operate the cache.

    layered-cache config check FILE [--json]
    layered-cache inspect NAMESPACE field=value ... --config FILE [--json]
    layered-cache invalidate NAMESPACE field=value ... --config FILE
    layered-cache hotkeys --config FILE [--json]
    layered-cache warm NAMESPACE --from FILE.jsonl --config FILE [--concurrency N]
                       [--start-line K]
    layered-cache daemon --config FILE [--log-format json|console] [--health-port N]

There is no ``bench`` command: the benchmarks live in ``bench/`` of a source checkout,
which the wheel does not ship (``make bench`` runs them there).

Bad input (config, unknown namespace, missing/unknown/unsafe field, unreadable file,
unreachable Redis) prints ``layered-cache: error: ...`` on stderr and exits with 2,
without a traceback. Passwords in URLs are never printed. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, BinaryIO, TextIO, TypeVar

import msgspec
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError

from layered_cache.cache import LayeredCache
from layered_cache.codec import CodecError, decode_meta
from layered_cache.config import (
    Config,
    ConfigError,
    Duration,
    HotConfig,
    L1Config,
    L2Config,
    NamespaceConfig,
    Rate,
    load_config,
)
from layered_cache.hotreport import fleet_hot_keys
from layered_cache.invalidation import names_to_delete
from layered_cache.keys import lease_name, replica_names
from layered_cache.l2 import L2Unavailable
from layered_cache.logs import configure_logging
from layered_cache.policy import Policy
from layered_cache.redact import redact, redact_data, redact_url
from layered_cache.warm import (
    STOPPED_BY_SIGINT,
    JsonlReader,
    Progress,
    Warmer,
    WarmReport,
    file_size,
)

__all__ = ["CliError", "build_parser", "main", "parse_fields"]

T = TypeVar("T")
EXIT_PARTIAL = 1  # warm: finished, but some entries failed (listed on stderr)
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
_INT = re.compile(r"-?[1-9][0-9]*|0")


class CliError(Exception):
    """Bad input or an unusable environment: printed without a traceback, exit 2."""


# -- helpers -----------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _format_ms(pttl: int) -> str:
    if pttl == -1:
        return "no expiry"
    if pttl == -2:
        return "missing"
    return f"{pttl / 1000:.1f}s"


def _relative(seconds: float) -> str:
    span = abs(seconds)
    text = (
        f"{span:.1f}s"
        if span < 120
        else f"{span / 60:.1f}m"
        if span < 7200
        else f"{span / 3600:.1f}h"
    )
    return f"in {text}" if seconds >= 0 else f"{text} ago"


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds")


def parse_fields(items: Sequence[str], policy: Policy) -> tuple[dict[str, object], str]:
    """``["id=42", "lang=en"]`` -> ({"id": 42, "lang": "en"}, full key), validated.

    Canonical integers become ints ("42" -> 42; "007" stays a string)."""
    fields: dict[str, object] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"expected field=value, got {item!r}")
        if name in fields:
            raise CliError(f"field {name!r} given twice")
        fields[name] = int(value) if _INT.fullmatch(value) else value
    template = policy.template
    unknown = sorted(set(fields) - set(template.fields))
    if unknown:
        raise CliError(
            f"namespace {policy.name!r}: unknown field(s) {unknown} "
            f"(template {template.template!r} has {list(template.fields)})"
        )
    return fields, _build_key(policy, fields)


def _build_key(policy: Policy, fields: dict[str, object]) -> str:
    try:
        return policy.template.build(fields)
    except (KeyError, ValueError) as exc:
        raise CliError(str(exc.args[0]) if exc.args else str(exc)) from None


def _policy(cache: LayeredCache, namespace: str) -> Policy:
    try:
        return cache.policy(namespace)
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None


def _load(path: str) -> Config:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _print_json(data: Any, out: TextIO) -> None:
    out.write(json.dumps(redact_data(data), indent=2, sort_keys=False, default=str) + "\n")


class Masters(msgspec.Struct, frozen=True):
    """A cluster's masters as the CLI found them: the dead ones ("host:port" -> why, as
    the PING to that node failed) and the live ones. Always empty off a cluster."""

    dead: dict[str, str] = msgspec.field(default_factory=dict)
    live: list[str] = msgspec.field(default_factory=list)
    slots: dict[str, str] = msgspec.field(default_factory=dict)  # dead node -> "0-5460"


async def _reach(cache: LayeredCache, config: Config) -> None:
    """Raise a ``CliError`` naming the configured URL if no Redis answers at all.

    A cluster client only needs one seed to learn the slot map; a dead master is found
    (and named) by ``_masters`` afterwards, not reported as the seed's failure."""
    client: Any = cache.l2.client
    first = client.initialize() if config.redis.cluster else client.ping()
    try:
        await asyncio.wait_for(first, config.redis.connect_timeout + 2.0)
    except Exception as exc:  # connection refused, auth, TLS, DNS, cluster init...
        url = redact_url(config.redis.url)
        raise CliError(f"cannot reach Redis at {url}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".rstrip(": .") if str(exc) else type(exc).__name__
    return redact(text)


async def _masters(cache: LayeredCache, config: Config) -> Masters:
    """PING every master of the slot map, each on its own connection, concurrently."""
    if not config.redis.cluster:
        return Masters()
    client: Any = cache.l2.client
    nodes = client.get_primaries()
    limit = config.redis.connect_timeout + config.redis.timeout

    async def ping(node: Any) -> str | None:
        try:
            await asyncio.wait_for(node.execute_command("PING"), limit)
        except Exception as exc:  # refused, timeout, LOADING, ...
            return _why(exc)
        return None

    results = await asyncio.gather(*(ping(node) for node in nodes))
    dead = {node.name: why for node, why in zip(nodes, results, strict=True) if why is not None}
    live = [node for node, why in zip(nodes, results, strict=True) if why is None]
    masters = Masters(dead, [n.name for n in live], {n: _slot_ranges(client, n) for n in dead})
    if dead and live and await _cluster_failed(live[0], limit):
        raise CliError(
            f"{_down(masters)}, and the cluster refuses every key (cluster_state:fail, as "
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
    owned = sorted(slot for slot, nodes in client.nodes_manager.slots_cache.items()
                   if nodes and nodes[0].name == node)  # fmt: skip
    ranges: list[list[int]] = []
    for slot in owned:
        if ranges and ranges[-1][1] == slot - 1:
            ranges[-1][1] = slot
        else:
            ranges.append([slot, slot])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges) or "none"


def _owner(cache: LayeredCache, name: str) -> str:
    """The master ("host:port") whose slot holds ``name``, per the client's slot map."""
    client: Any = cache.l2.client
    return str(client.nodes_manager.slots_cache[key_slot(name.encode())][0].name)


def _down(masters: Masters) -> str:
    """'master 127.0.0.1:7001 is down (why; slots 5461-10922)', for one or more."""
    parts = [f"{name} ({why}; slots {masters.slots[name]})" for name, why in masters.dead.items()]
    noun = "master" if len(parts) == 1 else "masters"
    verb = "is" if len(parts) == 1 else "are"
    return f"Redis Cluster {noun} {', '.join(parts)} {verb} down"


def _still_working(masters: Masters) -> str:
    return (
        f"still working: `inspect` and `invalidate` of keys whose slots are on the live "
        f"masters ({', '.join(masters.live)}), with cluster-require-full-coverage no "
        "(docs/operations.md)"
    )


@contextlib.asynccontextmanager
async def _degraded_ok(config: Config) -> AsyncIterator[tuple[LayeredCache, Masters]]:
    """A cache that answered, with the dead cluster masters if any (no backplane
    listener: a CLI needs none). For single-key commands, which work on live slots."""
    cache = LayeredCache.from_config(config)
    try:
        await _reach(cache, config)
        masters = await _masters(cache, config)
        if masters.dead and not masters.live:
            raise CliError(f"{_down(masters)}: no master answers")
        yield cache, masters
    finally:
        await cache.close()


@contextlib.asynccontextmanager
async def _connected(config: Config, command: str) -> AsyncIterator[LayeredCache]:
    """A cache whose Redis answered, every cluster master included: ``command`` needs
    them all (it scans or writes keys anywhere)."""
    async with _degraded_ok(config) as (cache, masters):
        if masters.dead:
            raise CliError(
                f"{_down(masters)}: `{command}` needs every master; {_still_working(masters)}"
            )
        yield cache


def _run(command: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, with Redis failing halfway through reported as a ``CliError``
    (one line, redacted) instead of a traceback."""
    try:
        return asyncio.run(command)
    except ClusterDownError as exc:
        raise CliError(
            f"Redis Cluster is down: {_why(exc)}. With cluster-require-full-coverage yes "
            "(the Redis default) one dead master stops every key; cache clusters should "
            "run with `no` (docs/operations.md)"
        ) from None
    except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
        raise CliError(f"Redis failed: {_why(exc)}") from None


async def _pttl(cache: LayeredCache, name: str) -> int:
    return int(await cache.l2.client.pttl(name))


# -- config check ------------------------------------------------------------------------


def _value(value: Any) -> Any:
    if isinstance(value, Duration):
        return format_duration(value)
    if isinstance(value, Rate):
        return f"{value:g}/s"
    if isinstance(value, msgspec.Struct):
        return {name: _value(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list | tuple):
        return [_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _value(item) for key, item in value.items()}
    return value


def effective_namespace(ns: NamespaceConfig) -> dict[str, Any]:
    """A namespace with every default filled in and ``true``/``false`` layers resolved."""
    if not ns.cache:
        return {"key": ns.key, "cache": False}
    layers: dict[str, Any] = {
        "l1": L1Config() if ns.l1 is True else ns.l1,
        "l2": L2Config() if ns.l2 is True else ns.l2,
        "hot": HotConfig() if ns.hot is True else ns.hot,
    }
    result: dict[str, Any] = {"key": ns.key, "cache": True}
    for name, layer in layers.items():
        result[name] = _value(layer) if layer is not False else "off"
    result["stampede"] = _value(ns.stampede)
    result["stale"] = _value(ns.stale)
    result["max_value_bytes"] = ns.max_value_bytes
    return result


def effective_config(config: Config) -> dict[str, Any]:
    redis_section = _value(config.redis)
    redis_section["url"] = redact_url(config.redis.url)
    if config.redis.password is not None:
        redis_section["password"] = "***"
    kafka = _value(config.kafka)
    if config.kafka.sasl_password is not None:
        kafka["sasl_password"] = "***"
    return {
        "source": config.source,
        "warnings": list(config.warnings),
        "redis": redis_section,
        "kafka": kafka,
        "backplane": _value(config.backplane),
        "logging": _value(config.logging),
        "metrics": _value(config.metrics),
        "namespaces": {name: effective_namespace(ns) for name, ns in config.namespaces.items()},
        "events": [
            {
                "type": route.type,
                "invalidate": [
                    {"namespace": t.namespace, "key": dict(t.key)} for t in route.invalidate
                ],
            }
            for route in config.events
        ],
    }


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{key}={_inline(item)}" for key, item in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_inline(item) for item in value) + "]"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def cmd_config_check(args: argparse.Namespace, out: TextIO) -> int:
    config = _load(args.file)
    data = effective_config(config)

    def write(text: str) -> None:
        out.write(redact(text))

    if args.json:
        _print_json(data, out)
        return 0
    write(
        f"{config.source}: OK ({len(config.namespaces)} namespaces, "
        f"{len(config.events)} event routes)\n"
    )
    for warning in config.warnings:
        write(f"warning: {warning}\n")
    for section in ("redis", "kafka", "backplane", "logging", "metrics"):
        write(f"[{section}] {_inline(data[section])}\n")
    for name, ns in data["namespaces"].items():
        write(f"\n[namespaces.{name}] key={ns['key']}\n")
        if not ns["cache"]:
            write("  cache = false (never cached: always read live)\n")
            continue
        for layer in ("l1", "l2", "hot", "stampede", "stale"):
            write(f"  {layer}: {_inline(ns[layer])}\n")
        write(f"  max_value_bytes: {ns['max_value_bytes']}\n")
    for route in data["events"]:
        targets = ", ".join(f"{t['namespace']}({_inline(t['key'])})" for t in route["invalidate"])
        write(f"\n[events] {route['type']} -> {targets}\n")
    return 0


# -- inspect -----------------------------------------------------------------------------


def _on_dead(cache: LayeredCache, masters: Masters, names: Sequence[str]) -> dict[str, list[str]]:
    """Of ``names``, those whose slot is on a dead master, by master."""
    found: dict[str, list[str]] = {}
    if masters.dead:
        for name in names:
            owner = _owner(cache, name)
            if owner in masters.dead:
                found.setdefault(owner, []).append(name)
    return found


def _key_on_dead_master(key: str, owner: str, masters: Masters) -> CliError:
    return CliError(
        f"{key} is in slot {key_slot(key.encode())}, on master {owner}. "
        f"{_down(masters)}; {_still_working(masters)}"
    )


async def _inspect(config: Config, namespace: str, items: Sequence[str]) -> dict[str, Any]:
    async with _degraded_ok(config) as (cache, masters):
        policy = _policy(cache, namespace)
        _, key = parse_fields(items, policy)
        for owner in _on_dead(cache, masters, [key]):  # its lease shares the slot
            raise _key_on_dead_master(key, owner, masters)
        unreachable = _on_dead(cache, masters, replica_names(key, policy.replicas))
        client = cache.l2.client
        now = time.time()
        data: Any = await client.get(key)
        base: dict[str, Any] = {"exists": data is not None, "pttl_ms": await _pttl(cache, key)}
        if data is not None:
            base["size"] = len(data)
            try:
                meta = decode_meta(data)
            except CodecError as exc:
                base["envelope"] = {"error": f"not a layered_cache envelope: {exc}"}
            else:
                base["envelope"] = {
                    "format": meta.format,
                    "written_at": _iso(meta.written_at),
                    "age_s": round(now - meta.written_at, 3),
                    "soft_expiry": _iso(meta.soft_expiry),
                    "soft_expiry_in_s": round(meta.soft_expiry - now, 3),
                    "fresh": now < meta.soft_expiry,
                    "delta_s": meta.delta,
                    "value_size": len(meta.value),
                }
        replicas: list[dict[str, Any]] = []
        skipped = {name for names in unreachable.values() for name in names}
        for name in replica_names(key, policy.replicas):
            if name in skipped:
                continue
            pttl = await _pttl(cache, name)
            if pttl != -2:
                replicas.append({"name": name, "pttl_ms": pttl})
        lease = lease_name(key)
        holder: Any = await client.get(lease)
        return {
            "namespace": namespace,
            "template": policy.template.template,
            "key": key,
            "base": base,
            "replicas_configured": policy.replicas,
            "replicas": replicas,
            "replicas_unreachable": {node: names for node, names in unreachable.items()},
            "lease": {
                "name": lease,
                "holder": holder.decode(errors="replace") if holder is not None else None,
                "pttl_ms": await _pttl(cache, lease) if holder is not None else None,
            },
        }


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    config = _load(args.config)
    report = _run(_inspect(config, args.namespace, args.fields))
    if args.json:
        _print_json(report, out)
        return 0
    base = report["base"]
    out.write(f"namespace  {report['namespace']} (template {report['template']})\n")
    out.write(f"key        {report['key']}\n")
    if not base["exists"]:
        out.write("L2         absent\n")
    else:
        out.write(f"L2         present, {base['size']} bytes, PTTL {_format_ms(base['pttl_ms'])}\n")
        env = base["envelope"]
        if "error" in env:
            out.write(f"envelope   {env['error']}\n")
        else:
            state = "fresh" if env["fresh"] else "stale (served only by the fail-safe)"
            out.write(f"written_at {env['written_at']} ({_relative(-env['age_s'])})\n")
            out.write(
                f"soft_exp   {env['soft_expiry']} ({_relative(env['soft_expiry_in_s'])}): {state}\n"
            )
            out.write(f"delta      {env['delta_s']:.4f}s (measured load time, XFetch)\n")
            out.write(f"size       {env['value_size']} bytes of value\n")
    configured = report["replicas_configured"]
    if configured:
        present = ", ".join(
            f"{r['name'].rsplit('#', 1)[1]} ({_format_ms(r['pttl_ms'])})"
            for r in report["replicas"]
        )
        out.write(
            f"replicas   {len(report['replicas'])}/{configured} exist"
            + (f": #{present}" if present else "")
            + "\n"
        )
        for node, names in report["replicas_unreachable"].items():
            shards = ", #".join(name.rsplit("#", 1)[1] for name in names)
            out.write(f"           unknown: #{shards} (on master {node}, which is down)\n")
    else:
        out.write("replicas   none (namespace has no hot-key replicas)\n")
    lease = report["lease"]
    if lease["holder"] is None:
        out.write(f"lease      {lease['name']}: free\n")
    else:
        out.write(
            f"lease      {lease['name']}: held by token {lease['holder']} "
            f"(PTTL {_format_ms(lease['pttl_ms'])})\n"
        )
    return 0


# -- invalidate --------------------------------------------------------------------------


async def _invalidate(config: Config, namespace: str, items: Sequence[str]) -> tuple[str, int]:
    async with _degraded_ok(config) as (cache, masters):
        policy = _policy(cache, namespace)
        fields, key = parse_fields(items, policy)
        _refuse_partial_invalidation(cache, config, masters, key, policy.replicas)
        names = [key, *replica_names(key, policy.replicas), lease_name(key)]
        existed = int(sum([await cache.l2.client.exists(name) for name in names]))
        try:
            await cache.invalidate(namespace, fields)
        except L2Unavailable as exc:
            raise CliError(f"invalidation failed: {redact(str(exc))}") from None
        return key, existed


def _refuse_partial_invalidation(
    cache: LayeredCache, config: Config, masters: Masters, key: str, replicas: int
) -> None:
    """Delete nothing unless every name can be deleted and announced: a half-done
    invalidation (say, replicas left on a master that comes back) would look done."""
    names = names_to_delete(key, replicas)
    if config.backplane.enabled:
        names.append(config.redis.prefix + config.backplane.stream)
    blocked = _on_dead(cache, masters, names)
    if blocked:
        where = "; ".join(f"{', '.join(found)} on {node}" for node, found in blocked.items())
        raise CliError(
            f"cannot invalidate {key}: {where}. {_down(masters)}; nothing was deleted. "
            f"Retry when it is back or its slots have moved; {_still_working(masters)}"
        )


def cmd_invalidate(args: argparse.Namespace, out: TextIO) -> int:
    config = _load(args.config)
    key, existed = _run(_invalidate(config, args.namespace, args.fields))
    where = "announced on the backplane" if config.backplane.enabled else "backplane disabled"
    out.write(f"invalidated {key}: {existed} name(s) deleted (key, replicas, lease); {where}\n")
    return 0


# -- hotkeys -----------------------------------------------------------------------------


async def _hotkeys(config: Config) -> dict[str, Any]:
    async with _connected(config, "hotkeys") as cache:
        result: dict[str, Any] = {}
        for name, ns in config.namespaces.items():
            policy = cache.policy(name)
            hot = HotConfig() if ns.hot is True else ns.hot
            if hot is False or policy.hot is None:
                continue
            keys: list[dict[str, Any]] = []
            for static in sorted(policy.hot.static):
                present = [
                    index
                    for index, replica in enumerate(replica_names(static, policy.replicas))
                    if await cache.l2.client.exists(replica)
                ]
                keys.append(
                    {
                        "key": static,
                        "base_exists": bool(await cache.l2.client.exists(static)),
                        "replicas_present": present,
                    }
                )
            result[name] = {
                "replicas": policy.replicas,
                "threshold": f"{hot.threshold:g}/s" if hot.threshold is not None else None,
                "static": keys,
                "detected": [],
            }
        # Live detection, as reported by every running instance (see hotreport.py).
        fleet = await fleet_hot_keys(cache.l2.client, config.redis.prefix)
        for name, detected in fleet.items():
            if name in result:
                result[name]["detected"] = [
                    {
                        "key": key,
                        "rate": round(entry["rate"], 1),
                        "instances": int(entry["instances"]),
                    }
                    for key, entry in sorted(detected.items(), key=lambda kv: -kv[1]["rate"])
                ]
        return result


def cmd_hotkeys(args: argparse.Namespace, out: TextIO) -> int:
    config = _load(args.config)
    report = _run(_hotkeys(config))
    if args.json:
        _print_json(report, out)
        return 0
    if not report:
        out.write("no namespace has hot-key replicas configured\n")
    for name, info in report.items():
        detection = f"detection above {info['threshold']}" if info["threshold"] else "no detection"
        out.write(f"[{name}] replicas={info['replicas']}, {detection}\n")
        if not info["static"] and not info["detected"]:
            out.write("  no static or detected hot keys\n")
        for entry in info["static"]:
            present = entry["replicas_present"]
            out.write(
                f"  {entry['key']}: base {'present' if entry['base_exists'] else 'absent'}, "
                f"replicas {len(present)}/{info['replicas']}"
                + (f" (#{', #'.join(map(str, present))})" if present else "")
                + "\n"
            )
        for entry in info["detected"]:
            out.write(
                f"  {entry['key']}: detected hot, {entry['rate']:g} L2 reads/s "
                f"(reported by {entry['instances']} instance(s))\n"
            )
    out.write(
        "\nDetected keys come from the running instances (each reports its own detection "
        "about once a second); static keys come from the config.\n"
    )
    return 0


# -- warm --------------------------------------------------------------------------------


class WarmArgs(msgspec.Struct, frozen=True):
    namespace: str
    path: str
    concurrency: int
    start_line: int


def _without_l1(config: Config) -> Config:
    """The config with every L1 off: a CLI process exits right after warming, so an L1
    copy of each value would only cost memory (up to ``max_entries`` values)."""
    namespaces = {
        name: msgspec.structs.replace(ns, l1=False) for name, ns in config.namespaces.items()
    }
    return msgspec.structs.replace(config, namespaces=namespaces)


async def _warm(config: Config, args: WarmArgs, source: BinaryIO, stream: TextIO) -> WarmReport:
    async with _connected(_without_l1(config), "warm") as cache:
        policy = _policy(cache, args.namespace)
        if not policy.cache or not policy.l2:
            raise CliError(
                f"namespace {args.namespace!r} has no L2 (cache or l2 is off): nothing to warm"
            )
        reader = JsonlReader(source, policy, args.start_line)
        progress = Progress(file_size(source), f"warm {args.namespace}", stream)
        warmer = Warmer(cache, policy, reader, args.concurrency, progress)
        with _on_sigint(warmer.interrupt):
            return await warmer.run()


@contextlib.contextmanager
def _on_sigint(handler: Callable[[], None]) -> Iterator[None]:
    """Route SIGINT to ``handler`` inside the loop instead of raising KeyboardInterrupt
    into whichever task happens to run (which loses the summary and leaves tasks whose
    exception nobody retrieves)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _warm_summary(report: WarmReport, args: WarmArgs, out: TextIO) -> None:
    read = "read so far" if report.stopped_by is not None else ""
    line = f"warmed {report.warmed} of {report.read} {args.namespace} entries {read}".rstrip()
    if report.failed:
        line += f"; {report.failed} failed"
    if report.not_cached:
        line += f"; {report.not_cached} not cached by set() (see the log)"
    out.write(line + "\n")
    if report.resume_line is not None:
        out.write(
            f"stopped at line {report.resume_line} ({report.stopped_by}); every entry before "
            f"it is warmed or listed as failed. Resume with --start-line {report.resume_line}\n"
        )


def _warm_failures(report: WarmReport, path: str, err: TextIO) -> None:
    for failure in report.failures:
        err.write(redact(f"{path}:{failure.line}: {failure.reason}") + "\n")
    hidden = report.failed - len(report.failures)
    if hidden > 0:
        err.write(f"... and {hidden} more failed line(s)\n")


def cmd_warm(args: argparse.Namespace, out: TextIO) -> int:
    config = _load(args.config)
    if args.concurrency < 1:
        raise CliError("--concurrency must be >= 1")
    if args.start_line < 1:
        raise CliError("--start-line must be >= 1")
    warm = WarmArgs(args.namespace, args.source, args.concurrency, args.start_line)
    try:
        source = open(warm.path, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise CliError(f"{warm.path}: cannot read: {exc.strerror or exc}") from None
    with source:
        report = _run(_warm(config, warm, source, sys.stderr))
    _warm_failures(report, warm.path, sys.stderr)
    _warm_summary(report, warm, out)
    if report.stopped_by == STOPPED_BY_SIGINT:
        return EXIT_INTERRUPTED
    if report.stopped_by is not None:
        return EXIT_ERROR
    return EXIT_PARTIAL if report.failed or report.not_cached else 0


# -- daemon ------------------------------------------------------------------------------


def cmd_daemon(args: argparse.Namespace, out: TextIO) -> int:
    """Runs until SIGTERM/SIGINT; imported here so other commands don't load aiokafka."""
    from layered_cache.daemon.main import run

    args.config = args.daemon_config  # after main(): the daemon sets its own logging up
    return run(args)


# -- entry point -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layered-cache", description="Inspect and operate a layered_cache deployment."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="configuration tools")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser(
        "check", help="validate a config file and print the effective policies"
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument("--json", action="store_true", help="print the effective config as JSON")
    check.set_defaults(handler=cmd_config_check, needs_config=False)

    def keyed(name: str, help_text: str, handler: Callable[..., int]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("namespace", metavar="NAMESPACE")
        sub.add_argument("fields", nargs="+", metavar="field=value")
        sub.add_argument("--config", required=True, metavar="FILE")
        sub.set_defaults(handler=handler)
        return sub

    inspect = keyed("inspect", "show a key in Redis: TTLs, replicas, lease, envelope", cmd_inspect)
    inspect.add_argument("--json", action="store_true")
    keyed("invalidate", "delete a key, its replicas and lease; drop L1 everywhere", cmd_invalidate)

    hotkeys = commands.add_parser("hotkeys", help="static hot keys and their replicas in Redis")
    hotkeys.add_argument("--config", required=True, metavar="FILE")
    hotkeys.add_argument("--json", action="store_true")
    hotkeys.set_defaults(handler=cmd_hotkeys)

    warm = commands.add_parser("warm", help="bulk fill a namespace from a JSONL file")
    warm.add_argument("namespace", metavar="NAMESPACE")
    warm.add_argument("--from", dest="source", required=True, metavar="FILE",
                      help='JSONL: one {"key": {...fields}, "value": ...} per line')  # fmt: skip
    warm.add_argument("--config", required=True, metavar="FILE")
    warm.add_argument("--concurrency", type=int, default=32, help="parallel writes (32)")
    warm.add_argument("--start-line", type=int, default=1, metavar="K",
                      help="skip the lines before K (resume where a stopped run said)")  # fmt: skip
    warm.set_defaults(handler=cmd_warm)

    daemon = commands.add_parser(
        "daemon", help="run the Kafka invalidation daemon (see docs/daemon.md)"
    )
    daemon.add_argument("--config", dest="daemon_config", required=True, metavar="FILE")
    daemon.add_argument("--log-format", choices=["json", "console"], default=None,
                        help="override logging.format (and LAYERED_CACHE_LOG_FORMAT)")  # fmt: skip
    daemon.add_argument("--health-port", type=int, default=None,
                        help="override kafka.health_port (0 = ephemeral, -1 = off)")  # fmt: skip
    daemon.set_defaults(handler=cmd_daemon)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config_path = getattr(args, "config", None)
    try:
        if config_path is not None:
            # Library warnings (breaker, fallbacks) go to stderr in the configured format.
            configure_logging(_load(config_path).logging)
        handler: Callable[[argparse.Namespace, TextIO], int] = args.handler
        return handler(args, sys.stdout)
    except CliError as exc:
        print(f"layered-cache: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as exc:  # e.g. an unknown logging format
        print(f"layered-cache: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
