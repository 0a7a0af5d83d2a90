"""deploy/grafana/layered-cache.json asks only for metrics the code exports.

The exported names come from real scrapes - ``layered_cache.prometheus.render_metrics``
over two caches on a real Redis, and the daemon's ``/metrics`` rendering
(``DaemonMetrics.render``) - never from a hand-kept list, so renaming a metric without
the dashboard (or the reverse) fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from layered_cache import LayeredCache
from layered_cache.daemon.metrics import DaemonMetrics
from layered_cache.daemon.stats import DaemonStats
from layered_cache.prometheus import register_cache, render_metrics
from tests.helpers import CountingLoader, eventually, make_config

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/grafana/layered-cache.json"
# Words of PromQL that are not metric names (functions are recognised by their "(").
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset", "inf", "nan"}  # fmt: skip
# What the issue asks the dashboard to show (panel titles).
REQUIRED_PANELS = ("Hit ratio per layer", "Loads and coalesced requests", "Lease waits",
                   "Hot keys", "Breaker state", "Backplane lag", "Daemon lag",
                   "Daemon throughput")  # fmt: skip

# -- reading the dashboard and PromQL -----------------------------------------------------


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels(_dashboard()["panels"]) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"[^"]*"', '""', expr)  # label values, e.g. "$namespace"
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group() in KEYWORDS:
            continue  # a function or a keyword
        names.add(match.group())
    return names


def selectors(expr: str) -> Iterator[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher."""
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', match.group(2)):
            yield match.group(1), label, op, value


def test_metric_names_reads_promql() -> None:
    expr = (
        'sum by (namespace) (rate(layered_cache_requests_total{result="l1_hit"}[$__rate_interval]))'
        " / ignoring(result) group_left max(layered_cache_hot_keys) + 0.5 * up"
    )
    assert metric_names(expr) == {"layered_cache_requests_total", "layered_cache_hot_keys", "up"}
    assert list(selectors(expr)) == [("layered_cache_requests_total", "result", "=", "l1_hit")]


# -- what the code exports, from real scrapes ---------------------------------------------

# sample name -> {label name -> values seen}
Exported = dict[str, dict[str, set[str]]]


def _parse(body: bytes, into: Exported) -> None:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}  # fmt: skip
    for family in text_string_to_metric_families(body.decode()):
        for suffix in suffixes.get(family.type, ("",)):  # a family without series yet
            into.setdefault(family.name + suffix, {})
        for sample in family.samples:
            labels = into.setdefault(sample.name, {})
            for name, value in sample.labels.items():
                labels.setdefault(name, set()).add(value)


async def _scrape_caches(redis_url: str, prefix: str, into: Exported) -> None:
    namespaces = {
        "book": {"key": "book:{id}", "l1": {"ttl": "60s"}},
        "author": {"key": "author:{id}", "l1": False, "hot": {"replicas": 2, "keys": ["author:1"]}},
    }
    config = make_config(redis_url, prefix, namespaces, backplane={"block": "200ms"})
    registry = CollectorRegistry()
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        register_cache(a, registry)
        register_cache(b, registry)
        for cache in (a, b, b):
            await cache.get_or_load("book", {"id": 1}, CountingLoader("v"))
            await cache.get_or_load("author", {"id": 1}, CountingLoader("a"))
        await a.invalidate("book", {"id": 1})
        assert await eventually(lambda: b.backplane_status().entries_applied == 1)  # type: ignore[union-attr]
        _parse(render_metrics(registry)[0], into)


async def test_every_dashboard_query_reads_an_exported_metric(redis_url: str, prefix: str) -> None:
    exported: Exported = {}
    await _scrape_caches(redis_url, prefix, exported)
    stats = DaemonStats()
    stats.count_events({"BookPriceChanged": 2})
    stats.batch_done(0.01)
    daemon = DaemonMetrics(stats, lambda: ({("catalog-events", 0): 3}, 1))
    _parse(daemon.render(), exported)
    assert "layered_cache_backplane_lag_seconds" in exported  # both sources were read
    assert "layered_cache_daemon_lag" in exported

    exprs = _exprs()
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"reads no metric: {expr}"
        for name in names:
            assert name in exported, f"{name} is not exported (query: {expr})"
        for metric, label, op, value in selectors(expr):
            labels = exported[metric]
            if not labels:
                continue  # no series in the scrape to compare labels against
            assert label in labels, f"{metric} has no label {label!r} (query: {expr})"
            if op == "=":
                assert value in labels[label], f"{metric}{{{label}={value!r}}} never occurs"
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            metric, label = re.fullmatch(
                r"label_values\((\w+),\s*(\w+)\)", variable["definition"]
            ).groups()  # type: ignore[union-attr]
            assert label in exported[metric], variable


def test_the_dashboard_has_the_panels_people_look_at() -> None:
    dashboard = _dashboard()
    panels = list(_panels(dashboard["panels"]))
    titles = {p["title"] for p in panels}
    for title in REQUIRED_PANELS:
        assert title in titles, f"no panel {title!r}"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
