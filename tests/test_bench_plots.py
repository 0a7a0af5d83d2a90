"""The benchmark plots on small synthetic input (matplotlib is in the `bench` extra, not
`dev`: these skip without it). Each figure is captured instead of written."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

import bench.plots as plots  # after the skip


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every figure a plot function saves, kept open for the test to read."""
    saved: list[Any] = []

    def keep(fig: Any, path: Path, tight: bool = True) -> str:
        saved.append(fig)
        return str(path)

    monkeypatch.setattr(plots, "_save", keep)
    return saved


def _texts(fig: Any) -> str:
    """The figure's text outside the axes (the note), on one line."""
    return " ".join(text.get_text() for text in fig.texts).replace("\n", " ")


def test_the_expiry_histogram_is_in_seconds_after_the_warm_up(figures: list[Any]) -> None:
    plots.expiry_histogram(
        {"fixed": [600] * 50 + [601] * 30, "jittered": list(range(540, 661))}, "t", Path("x.png")
    )
    [fig] = figures
    ax = fig.axes[0]
    assert ax.get_xlabel() == "seconds after the warm-up"
    low, high = ax.get_xlim()
    assert 500 < low < 540 and 660 < high < 700  # not epoch seconds (~1.8e9)
    fixed = ax.get_lines()[0]
    assert max(fixed.get_ydata()) == 50


async def test_the_jitter_scenario_plots_seconds_after_its_warm_up(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.jitter as jitter

    captured: dict[str, list[int]] = {}

    def histogram(series: dict[str, list[int]], title: str, path: Path) -> str:
        captured.update(series)
        return str(path)

    monkeypatch.setattr(jitter, "KEYS", 300)
    monkeypatch.setattr(jitter, "expiry_histogram", histogram)
    # Patient timeouts: the warm-up's burst of set() calls opens its connections at
    # once, which takes over a second on a machine kept busy (make test-stress).
    patient = functools.partial(jitter.make_config, timeout="10s", connect_timeout="10s")
    monkeypatch.setattr(jitter, "make_config", patient)

    class Env:
        def redis_url(self) -> str:
            return redis_url

        def plot_path(self, name: str) -> Path:
            return Path(name)

    section = await jitter.run(Env())  # type: ignore[arg-type]
    fixed, jittered = captured["fixed TTL (jitter 0)"], captured["jittered TTL (+-10%)"]
    assert all(598 <= second <= 601 for second in fixed)
    assert all(538 <= second <= 661 for second in jittered) and max(jittered) > 620
    assert sum(section.data["expiries_after_warmup_s"]["fixed TTL (jitter 0)"].values()) == 300


def test_the_hot_key_plot_shows_rates_per_node_over_its_window(figures: list[Any]) -> None:
    from bench.hotkey import plot_per_node

    nodes = ("a:1", "b:2", "c:3")
    without = {"gets_per_node": dict(zip(nodes, (0, 0, 12_000), strict=True)),
               "gets_per_s": 4_000.0, "reads_per_s": 16_000.0, "seconds": 3.0}  # fmt: skip
    # an older result without "seconds": the window is total GETs / GETs per second
    with_replicas = {"gets_per_node": dict(zip(nodes, (3_000, 3_000, 3_000), strict=True)),
                     "gets_per_s": 3_000.0, "reads_per_s": 12_000.0}  # fmt: skip
    plot_per_node(without, with_replicas, Path("x.png"))
    [fig] = figures
    ax = fig.axes[0]
    assert ax.get_title() == "Hot key: GETs/s per cluster node, 3 s of windows (L1 off)"
    assert ax.get_ylabel() == "GETs/s on the node"
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == [0, 0, 4_000, 1_000, 1_000, 1_000]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["no replicas (16,000 reads/s answered)",
                      "8 replicas (12,000 reads/s answered)"]  # fmt: skip
    assert "windows of both fleets interleaved" in _texts(fig)


def test_the_1_process_stampede_plot_says_why_a_contender_is_missing(
    figures: list[Any],
) -> None:
    from bench.stampede_local import plot_loads

    loads = {"plain cache-aside (redis.asyncio)": [200, 200], "layered_cache": [1, 1]}
    failed = {"dogpile.cache (redis, 200 threads)": "MaxConnectionsError: Too many connections"}
    plot_loads(loads, failed, Path("x.png"))
    [fig] = figures
    labels = [label.get_text() for label in fig.axes[0].get_xticklabels()]
    assert labels == ["plain cache-aside", "layered_cache"]
    note = _texts(fig)
    assert "Not shown: dogpile.cache (redis, 200 threads)" in note
    assert "100 connections" in note

    figures.clear()
    plot_loads(loads, {}, Path("x.png"))  # nothing missing: no note
    assert _texts(figures[0]) == ""


def test_bar_panels_draw_the_same_configurations_in_each_panel(figures: list[Any]) -> None:
    plots.bar_panels(
        {"requests/s": {"(a)": 2000.0, "(b)": 1000.0}, "p99, ms": {"(a)": 30.0, "(b)": 90.0}},
        "t", Path("x.png"), note="server and wrk share 2 cores",
    )  # fmt: skip
    [fig] = figures
    rates, p99 = fig.axes
    assert [t.get_text() for t in rates.get_xticklabels()] == ["(a)", "(b)"]
    assert [bar.get_height() for bar in p99.patches] == [30.0, 90.0]
    assert rates.get_ylabel() == "requests/s"
    assert "2 cores" in _texts(fig)
