"""Scenario 8: a hot key on a 3-master Redis Cluster, and the cost of hot-key detection.

Part A, per client: one ``LayeredCache`` instance, one sequential reader, L1 off, reading
one key on the cluster started by ``tests.servers.RedisClusterServers``: two instances
without replicas (their mean per round is the floor, their ratio the A/A resolution),
one with ``hot = {replicas = 8, keys = [...]}`` (static), and the same with turns of
``STICKY_READS`` reads only and with a new master on every read (how reads were spread
before issue 17). Short windows of each, interleaved; reported: the median GETs/s of
each and the median of the per-round ratios to the floor, the overhead being 1 - that
ratio, plus ``ReplicaPlacement.pick()``'s own CPU cost. Why: a client that reads a
different master each time pays for it (``_placement.py``).

Part B, the fleet: ``INSTANCES`` instances x ``READERS`` concurrent readers in this one
process, without and with replicas, windows interleaved; each node's ``GET`` count comes
from ``INFO commandstats`` (deltas around each window). Reported: the busiest node's
share of the key's GETs with replicas, and the fleet's GETs/s. Why: in a cluster a key
lives on one node, whose CPU then caps the whole cluster; replicas ``key#0..#7`` hash
to other slots and spread it, and sticky clients must still spread it as a fleet.

Part C, what: L2-hit latency on a standalone Redis with detection on (``hot.threshold``
set high enough that nothing is promoted) against the same namespace without ``hot``,
plus the detector's ``record()`` cost alone. Why: detection sits on every L2 read.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis

from bench.configs import make_config
from bench.env import BenchEnv, unique_prefix
from bench.floors import Batch, book_value, fmt_us, interleaved, median
from bench.plots import grouped_bars
from bench.report import Headline, Section
from layered_cache import LayeredCache
from layered_cache._placement import STICKY_READS, STICKY_SECONDS

INSTANCES = 16  # cache instances (stand-ins for pods): single-flight coalesces per instance
READERS = 4  # concurrent readers per instance
SHARE_TARGET = 0.45
OVERHEAD_TARGET = 0.05
CLIENT_WINDOW = 0.05  # seconds per per-client window: short and many, see _per_client
FLEET_WINDOW = 0.5  # seconds per fleet window

Loader = Callable[[], Awaitable[Any]]


def _config(cluster: Any, hot: bool) -> Any:
    ns: dict[str, Any] = {"key": "book:{id}", "l1": False}
    if hot:
        ns["hot"] = {"replicas": 8, "keys": ["book:1"]}
    return make_config(cluster.url, unique_prefix("hot"), {"book": ns}, cluster=True,
                       backplane=False)


async def _started(cluster: Any, hot: bool, count: int, loader: Loader,
                   sticky_reads: int | None = None) -> list[LayeredCache]:
    """``count`` instances of one config, each warmed up: connected to every node, and
    (hot) every replica present before measuring."""
    config = _config(cluster, hot)
    caches = [LayeredCache.from_config(config) for _ in range(count)]
    for cache in caches:
        await cache.start()
        if sticky_reads is not None:  # turns of that many reads, however short
            cache._store.placement.sticky_reads = sticky_reads
            cache._store.placement.sticky_seconds = 0.0
    await caches[0].get_or_load("book", {"id": 1}, loader)  # fill base (+ replicas if hot)
    for cache in caches:
        for _ in range(200 if count == 1 else 20):
            await cache.get_or_load("book", {"id": 1}, loader)
    return caches


async def _reads_for(caches: list[LayeredCache], readers: int, seconds: float,
                     loader: Loader) -> tuple[int, float]:
    """(reads answered, elapsed seconds) of ``readers`` loops per instance."""
    reads = 0
    deadline = time.perf_counter() + seconds

    async def reader(cache: LayeredCache) -> None:
        nonlocal reads
        while time.perf_counter() < deadline:
            await cache.get_or_load("book", {"id": 1}, loader)
            reads += 1

    start = time.perf_counter()
    await asyncio.gather(*(reader(c) for c in caches for _ in range(readers)))
    return reads, time.perf_counter() - start


def _node_gets(nodes: list[redis.Redis]) -> list[int]:
    return [int(n.info("commandstats").get("cmdstat_get", {}).get("calls", 0)) for n in nodes]


EVERY_READ = "8 replicas, a new master every read"
CLIENT_CASES = {  # name -> (hot, sticky_reads or None for the default)
    "no replicas": (False, None),
    "no replicas, a 2nd instance": (False, None),
    "8 replicas": (True, None),
    f"8 replicas, turns of {STICKY_READS} reads only": (True, STICKY_READS),
    EVERY_READ: (True, 1),
}


async def _per_client(cluster: Any, rounds: int) -> dict[str, Any]:
    """One instance per case, one sequential reader: GETs/s per window, the cases
    interleaved (the order rotating each round so no case always runs first). Two
    no-replica instances: their mean per round is the floor, their ratio (A/A) shows
    what two identical clients differ by here, i.e. the resolution of the figure."""
    value = book_value(1)

    async def loader() -> Any:
        return value

    cases = {
        name: (await _started(cluster, hot, 1, loader, sticky))[0]
        for name, (hot, sticky) in CLIENT_CASES.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    try:
        names = list(cases)
        for i in range(rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                cache = cases[name]
                before = cache.stats()["book"]
                gets_before = before["l2_hit"] + before["replica_miss"]
                _, elapsed = await _reads_for([cache], 1, CLIENT_WINDOW, loader)
                after = cache.stats()["book"]
                gets = after["l2_hit"] + after["replica_miss"] - gets_before
                rates[name].append(gets / elapsed)
        # What choosing a replica costs the CPU per read, without the network's noise.
        hot = cases["8 replicas"]
        placement, key = hot._store.placement, hot.key("book", {"id": 1})
        n = 200_000
        start = time.perf_counter()
        for _ in range(n):
            placement.pick(key, 8)
        pick_s = (time.perf_counter() - start) / n
    finally:
        for cache in cases.values():
            await cache.close()
    a, b = rates["no replicas"], rates["no replicas, a 2nd instance"]
    floor = [(x + y) / 2 for x, y in zip(a, b, strict=True)]

    def paired(values: list[float], over: list[float]) -> float:  # one ratio per round
        return statistics.median(v / f for v, f in zip(values, over, strict=True))

    return {
        "gets_per_s": {name: median(r) for name, r in rates.items()},
        "floor_gets_per_s": median(floor),
        "ratio": paired(rates["8 replicas"], floor),
        "ratio_every_read": paired(rates[EVERY_READ], floor),
        "ratios": {name: paired(rates[name], floor) for name in names if CLIENT_CASES[name][0]},
        "ratio_a_a": paired(b, a),
        "pick_s": pick_s,
        "rounds_gets_per_s": rates,
    }


FLEETS = {  # name -> (hot, sticky_reads or None for the default)
    "no replicas": (False, None),
    "8 replicas": (True, None),
    EVERY_READ: (True, 1),
}


async def _fleet(cluster: Any, rounds: int) -> dict[str, dict[str, Any]]:
    """Every fleet started once; their windows alternate (the order rotating each round),
    commandstats read around each window."""
    value = book_value(1)

    async def loader() -> Any:
        return value

    nodes = [redis.Redis(host=h, port=p, decode_responses=True) for h, p in cluster.nodes]
    fleets = {name: await _started(cluster, hot, INSTANCES, loader, sticky)
              for name, (hot, sticky) in FLEETS.items()}
    totals: dict[str, dict[str, Any]] = {
        name: {"gets": [0] * len(nodes), "seconds": 0.0, "gets_per_s": [], "reads_per_s": []}
        for name in fleets
    }
    try:
        await asyncio.sleep(0.2)
        names = list(fleets)
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                before = await asyncio.to_thread(_node_gets, nodes)
                reads, elapsed = await _reads_for(fleets[name], READERS, FLEET_WINDOW, loader)
                after = await asyncio.to_thread(_node_gets, nodes)
                t = totals[name]
                deltas = [a - b for a, b in zip(after, before, strict=True)]
                t["gets"] = [g + d for g, d in zip(t["gets"], deltas, strict=True)]
                t["seconds"] += elapsed
                t["gets_per_s"].append(sum(deltas) / elapsed)
                t["reads_per_s"].append(reads / elapsed)
        loads = {name: sum(c.stats()["book"]["load"] for c in fleet)
                 for name, fleet in fleets.items()}
    finally:
        for fleet in fleets.values():
            for cache in fleet:
                await cache.close()
        for node in nodes:
            node.close()
    results = {}
    floor = totals["no replicas"]["gets_per_s"]
    for name, t in totals.items():
        gets = {f"{h}:{p}": g for (h, p), g in zip(cluster.nodes, t["gets"], strict=True)}
        results[name] = {
            "gets_per_node": gets,
            "busiest_share": max(gets.values()) / (sum(gets.values()) or 1),
            "reads_per_s": median(t["reads_per_s"]),
            "gets_per_s": median(t["gets_per_s"]),
            "ratio": median([g / f for g, f in zip(t["gets_per_s"], floor, strict=True)]),
            "seconds": t["seconds"],
            "rounds_gets_per_s": t["gets_per_s"],
            "loads": loads[name],
        }
    return results


def per_node_rates(run: dict[str, Any]) -> dict[str, float]:
    """"node i" -> GETs/s it served over the run's window (older results without
    ``seconds``: the window is total GETs / GETs per second)."""
    gets = run["gets_per_node"]
    seconds = run.get("seconds") or sum(gets.values()) / run["gets_per_s"]
    return {f"node {i + 1}": count / seconds for i, count in enumerate(gets.values())}


def plot_per_node(without: dict[str, Any], with_replicas: dict[str, Any], path: Path) -> str:
    """GETs/s per node over the windows, each case labelled with the requests/s the
    clients got answered."""
    window = with_replicas.get("seconds") or sum(
        with_replicas["gets_per_node"].values()) / with_replicas["gets_per_s"]  # fmt: skip
    return grouped_bars(
        {
            f"{label} ({r['reads_per_s']:,.0f} reads/s answered)": per_node_rates(r)
            for label, r in (("no replicas", without), ("8 replicas", with_replicas))
        },
        f"Hot key: GETs/s per cluster node, {window:.0f} s of windows (L1 off)",
        "GETs/s on the node", path,
        note="Replicas spread the hot key's GETs over the nodes (windows of both fleets "
        "interleaved; one Python process on 2 cores runs all 16 instances, so the fleet's "
        "reads/s measure that process, not Redis).",
    )


async def _detection_overhead(env: BenchEnv, quick: bool) -> dict[str, Any]:
    url = env.redis_url()
    value = book_value()
    config = make_config(
        url, unique_prefix("det"),
        {
            "plain": {"key": "plain:{id}", "l1": False},
            "detect": {"key": "detect:{id}", "l1": False,
                       "hot": {"replicas": 8, "threshold": "10000000/s"}},
        },
    )

    async def loader() -> Any:
        return value

    async with LayeredCache.from_config(config) as cache:
        for ns in ("plain", "detect"):
            await cache.get_or_load(ns, {"id": 1}, loader)

        def batch_for(ns: str) -> Batch:
            async def batch(n: int) -> float:
                start = time.perf_counter()
                for _ in range(n):
                    await cache.get_or_load(ns, {"id": 1}, loader)
                return (time.perf_counter() - start) / n
            return batch

        results = await interleaved(
            {"no hot config": batch_for("plain"), "detection on": batch_for("detect")},
            3000, 5 if quick else 11, batch_seconds=0.25,
        )
        detector = cache.namespace("detect").policy.hot
        assert detector is not None and not detector.hot_keys(), "nothing should be promoted"
        key = cache.key("detect", {"id": 1})
        n = 200_000
        start = time.perf_counter()
        for _ in range(n):
            detector.record(key)
        record_s = (time.perf_counter() - start) / n
    plain_s, detect_s = median(results["no hot config"]), median(results["detection on"])
    # Paired: each repeat ran both back to back, so their ratio cancels slow phases.
    paired = median([d / p for d, p in zip(results["detection on"], results["no hot config"],
                                           strict=True)])
    return {"plain_s": plain_s, "detect_s": detect_s, "record_s": record_s,
            "overhead": paired - 1, "repeats_s": results}


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("hotkey", "8. Hot key on a 3-master cluster; detection overhead")
    client_rounds, fleet_rounds = (40, 4) if env.quick else (150, 12)
    try:
        cluster = await asyncio.to_thread(env.cluster)
        client = await _per_client(cluster, client_rounds)
        fleet = await _fleet(cluster, fleet_rounds)
        without, with_replicas = fleet["no replicas"], fleet["8 replicas"]
    except Exception as exc:
        section.notes.append(f"cluster part n/a: {type(exc).__name__}: {exc}")
        client = fleet = without = with_replicas = None
    section.columns = ["", "busiest node's share of GETs", "GETs per node",
                       "GETs/s (requests/s answered)"]
    if client and fleet and without and with_replicas:
        floor, gets = client["floor_gets_per_s"], client["gets_per_s"]
        for label, rate, ratio in (
            ("no replicas: the floor (mean of 2 instances)", floor, "1.000x"),
            ("no replicas, 2nd instance (A/A: / 1st)", gets["no replicas, a 2nd instance"],
             f"{client['ratio_a_a']:.3f}x the 1st"),
            *((name, gets[name], f"{r:.3f}x the floor") for name, r in client["ratios"].items()),
        ):
            section.rows.append([f"one client: {label}", "", "", f"{rate:,.0f} ({ratio})"])
        for name, r in fleet.items():
            section.rows.append([
                f"fleet: {name}", f"{r['busiest_share']:.0%}",
                " / ".join(f"{v:,}" for v in r["gets_per_node"].values()),
                f"{r['gets_per_s']:,.0f} ({r['reads_per_s']:,.0f}); {r['ratio']:.3f}x the floor",
            ])
        plot = plot_per_node(without, with_replicas, env.plot_path("hotkey_per_node.png"))
        section.data["plots"] = [plot]
        section.rows.append(
            ["one client: ReplicaPlacement.pick() alone", "", "",
             f"{fmt_us(client['pick_s'])} = {client['pick_s'] * floor:.2%} of a GET"]
        )
        section.notes.append(
            f"One client: one instance per case, one sequential reader, L1 off; "
            f"{client_rounds} rounds of {CLIENT_WINDOW:g} s windows of each case, the order "
            "rotating each round. GETs/s are medians; a ratio is the median of the "
            "per-round ratios to the floor of the same round, the mean of two identical "
            "no-replica instances. Their own ratio (A/A) is how far two identical clients "
            "differ on this shared machine: the resolution of the other ratios. "
            "'A new master every read' (sticky_reads = 1, sticky_seconds = 0) spreads one "
            "client's reads as before issue 17's fix (a random replica per read): the cost "
            "stickiness removes."
        )
        section.notes.append(
            f"Fleet: {INSTANCES} LayeredCache instances x {READERS} concurrent readers in "
            f"one process, L1 off; {fleet_rounds} rounds of {FLEET_WINDOW:g} s windows of "
            "each fleet, alternating; GETs per node are INFO commandstats deltas summed "
            "over the windows; the ratio is the median of per-round ratios of GETs/s to the "
            "no-replica fleet. Concurrent reads within one instance share one GET "
            "(single-flight), hence requests/s > GETs/s. Each instance reads one master "
            f"for a turn of >= {STICKY_READS} reads and >= {STICKY_SECONDS:g} s, then the "
            "next (a random start per instance): what caps a real cluster is the busiest "
            "node's share."
        )
        client_overhead = 1 - client["ratio"]
        section.headline.append(Headline(
            "Hot key, 3-master cluster: one client's GETs/s with 8 replicas; busiest node",
            f"{client['gets_per_s']['8 replicas']:,.0f} GETs/s = {client['ratio']:.3f}x "
            f"(overhead {client_overhead:+.1%}); busiest node {with_replicas['busiest_share']:.0%} "
            f"of {INSTANCES} instances' GETs",
            f"no replicas {floor:,.0f} GETs/s (A/A {client['ratio_a_a']:.3f}x), busiest node "
            f"{without['busiest_share']:.0%}; a new master every read "
            f"{client['ratio_every_read']:.3f}x; pick() {fmt_us(client['pick_s'])}",
            f"overhead <= {OVERHEAD_TARGET:.0%}, busiest <= {SHARE_TARGET:.0%}",
            "ok" if client_overhead <= OVERHEAD_TARGET
            and with_replicas["busiest_share"] <= SHARE_TARGET else "MISSED",
        ))
    else:
        section.headline.append(Headline("Hot key on the cluster", "n/a", "",
                                         "<= 5% overhead, <= 45%", "n/a"))
    det = await _detection_overhead(env, env.quick)
    section.rows.append(["", "", "", ""])
    section.rows += [
        ["L2 hit, no hot config (standalone Redis)", fmt_us(det["plain_s"]), "", ""],
        ["L2 hit, detection on (threshold never reached)", fmt_us(det["detect_s"]),
         f"{det['overhead']:+.1%}", ""],
        ["HotKeyDetector.record() alone", fmt_us(det["record_s"]),
         f"{det['record_s'] / det['plain_s']:.1%} of an L2 hit", ""],
    ]
    section.notes.append(
        "Detection overhead: median of per-repeat ratios (both run back to back in each repeat). "
        "On a shared 2-core machine a loopback round trip varies by more than 5 % between "
        "batches, so the verdict uses record()'s own CPU cost relative to an L2 hit, which "
        "is what detection adds to the path (one sketch update, no I/O)."
    )
    overhead = max(det["overhead"], det["record_s"] / det["plain_s"])
    section.headline.append(Headline(
        "Hot-key detection overhead on the L2 read path",
        f"record() {fmt_us(det['record_s'])} = {det['record_s'] / det['plain_s']:.1%} of an "
        f"L2 hit (wall, paired: {det['overhead']:+.1%})",
        f"L2 hit {fmt_us(det['plain_s'])}",
        f"<= {OVERHEAD_TARGET:.0%}",
        "ok" if det["record_s"] / det["plain_s"] <= OVERHEAD_TARGET else "MISSED",
    ))
    section.data.update({"client": client, "fleet": fleet, "without": without,
                         "with": with_replicas,
                         "detection": det,
                         "overhead_bound": overhead})
    section.seconds = time.perf_counter() - started
    return section
