"""Result sections, the markdown report, latest.json and the PNG plots.

Each scenario returns one :class:`Section`: a markdown table (already formatted), notes
(what is n/a and why, method), raw data for the JSON and the plots, and the rows it
contributes to the headline table that goes into the README.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Headline", "Section", "merge", "write_all"]

RESULTS = Path(__file__).parent / "results"


@dataclass
class Headline:
    """One row of the README table: what, our figure, the floor/peer, target, verdict."""

    scenario: str
    layered_cache: str
    reference: str
    target: str
    verdict: str  # "ok", "MISSED", "n/a", "info"


@dataclass
class Section:
    key: str
    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    headline: list[Headline] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    date: str = ""  # when this section was measured (a merged report mixes runs)
    kept: bool = False  # from an earlier run, kept by a ``--only`` run
    tables: list[Any] = field(default_factory=list)  # more [columns, rows] after the first


def _table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def headline_table(sections: list[Section]) -> str:
    rows = [
        [h.scenario, h.layered_cache, h.reference, h.target, h.verdict]
        for s in sections
        for h in s.headline
    ]
    return _table(["Scenario", "layered_cache", "floor / peers", "target", "result"], rows)


def render_markdown(sections: list[Section], machine: dict[str, Any], quick: bool) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    out = [
        "# layered_cache benchmarks" + (" (quick smoke run: fewer repeats)" if quick else ""),
        "",
        f"- Date: {machine['date']}",
        f"- Machine: {machine['nproc']} CPUs (`nproc`), {machine['cpu_model']}, "
        f"{machine['platform']}, load average at the end {machine.get('load_average_at_end', '?')} "
        "(the machine is shared; interleaved repeats and medians absorb most of it)",
        f"- Python {machine['python']}, redis-server {machine['redis_server']}",
        f"- Versions: {versions}",
        "- Every figure is the median of repeats; ratios are to a floor measured in the same run.",
        "  Reproduce with `make bench` (or `python -m bench`; `--quick` for a smoke run).",
        "",
        "## Headline",
        "",
        headline_table(sections),
        "",
    ]
    for section in sections:
        out += [f"## {section.title}", ""]
        if section.kept:
            out += [f"_Measured {section.date} (an earlier run, kept by a `--only` run)._", ""]
        if section.error:
            out += [f"**n/a**: {section.error}", ""]
        if section.rows:
            out += [_table(section.columns, section.rows), ""]
        for columns, rows in section.tables:
            out += [_table(columns, rows), ""]
        out += [f"- {note}" for note in section.notes]
        plots = section.data.get("plots", [])
        if section.notes:
            out.append("")
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        if plots:
            out.append("")
        out += [f"_({section.seconds:.1f} s)_", ""]
    return "\n".join(out)


def _previous(quick: bool) -> list[Section]:
    """The sections of the last report of the same kind (full or quick), if any."""
    try:
        payload = json.loads((RESULTS / "latest.json").read_text())
    except (OSError, ValueError):
        return []
    if payload.get("quick") != quick:
        return []
    known = set(Section.__dataclass_fields__)
    sections = []
    for raw in payload.get("sections", []):
        section = Section(**{k: v for k, v in raw.items() if k in known})
        section.headline = [Headline(**h) for h in raw.get("headline", [])]
        section.date = section.date or payload.get("machine", {}).get("date", "")
        section.kept = True
        sections.append(section)
    return sections


def merge(sections: list[Section], order: list[str], quick: bool) -> list[Section]:
    """This run's sections, plus the last report's sections this run didn't measure
    (``--only``), in scenario order."""
    new = {s.key: s for s in sections}
    kept = {s.key: s for s in _previous(quick) if s.key not in new}
    merged = {**kept, **new}
    rank = {key: i for i, key in enumerate(order)}
    return sorted(merged.values(), key=lambda s: rank.get(s.key, len(rank)))


def write_all(sections: list[Section], machine: dict[str, Any], quick: bool) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine,
        "quick": quick,
        "sections": [asdict(s) for s in sections],
    }
    (RESULTS / "latest.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    report = RESULTS / "REPORT.md"
    report.write_text(render_markdown(sections, machine, quick))
    return report
