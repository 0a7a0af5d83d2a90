"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["bar_chart", "bar_panels", "cdf", "expiry_histogram", "grouped_bars"]


def _save(fig: Any, path: Path, tight: bool = True) -> str:
    """Write ``fig`` to ``path`` (``BenchEnv.plot_path``: bench/results/, or a scratch
    directory under ``--no-write``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _note(fig: Any, note: str) -> None:
    """Text under the axes: what the chart leaves out and why."""
    if note:
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        fig.text(0.01, 0.01, "\n".join(textwrap.wrap(note, 110)), fontsize=8, va="bottom",
                 color="dimgray")


def expiry_histogram(series: dict[str, list[int]], title: str, path: Path) -> str:
    """Keys expiring per second, one line per series (fixed vs jittered TTL).

    ``series``: label -> each key's expiry in whole seconds *after the warm-up* (PTTL
    read right after it), so the axis reads 540..660 for a 600 s TTL +- 10 %, not raw
    epoch seconds."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, counts in series.items():
        hist = Counter(counts)
        if not hist:
            continue
        xs = list(range(min(hist) - 2, max(hist) + 3))
        ax.step(xs, [hist.get(x, 0) for x in xs], where="mid", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("seconds after the warm-up")
    ax.set_ylabel("keys expiring in that second (log)")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def bar_chart(
    values: dict[str, float], title: str, ylabel: str, path: Path, log: bool = False,
    note: str = "",
) -> str:  # fmt: skip
    """One bar per label; ``note`` is printed under the chart (say what is missing, why)."""
    fig, ax = plt.subplots(figsize=(8, 4.6 if note else 4))
    labels = list(values)
    bars = ax.bar(labels, [values[k] for k in labels], color="tab:blue")
    for bar, label in zip(bars, labels, strict=True):
        ax.annotate(f"{values[label]:g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    _note(fig, note)
    return _save(fig, path, tight=not note)


def bar_panels(
    panels: dict[str, dict[str, float]], title: str, path: Path, note: str = ""
) -> str:
    """One bar chart per panel, side by side, same labels in each (e.g. requests/s and
    p99 of the same configurations); ``panels``: y label -> {label: value}."""
    fig, _ = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.6 if note else 4))
    for ax, (ylabel, values) in zip(fig.axes, panels.items(), strict=True):
        labels = list(values)
        bars = ax.bar(range(len(labels)), [values[k] for k in labels],
                      color=[f"C{i}" for i in range(len(labels))])  # fmt: skip
        for bar, label in zip(bars, labels, strict=True):
            value = values[label]
            ax.annotate(f"{value:,.0f}" if value >= 100 else f"{value:.3g}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(["\n".join(textwrap.wrap(label, 14)) for label in labels], fontsize=8)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    _note(fig, note)
    return _save(fig, path, tight=not note)


def grouped_bars(
    groups: dict[str, dict[str, float]], title: str, ylabel: str, path: Path, note: str = ""
) -> str:
    """``groups``: series label -> {category: value}; ``note`` under the chart."""
    fig, ax = plt.subplots(figsize=(8, 4.6 if note else 4))
    categories = sorted({c for g in groups.values() for c in g})
    width = 0.8 / max(1, len(groups))
    for i, (label, values) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [values.get(c, 0) for c in categories], width, label=label)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(categories))])
    ax.set_xticklabels(categories)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    _note(fig, note)
    return _save(fig, path, tight=not note)


def cdf(series: dict[str, list[float]], title: str, xlabel: str, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, values in series.items():
        if not values:
            continue
        ordered = sorted(values)
        n = len(ordered)
        ax.plot(ordered, [(i + 1) / n for i in range(n)], label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of events")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
