"""Scenario 7: early refresh in virtual time (a pure simulation, no Redis).

Model: one key read 1,000 times a second (one request per virtual millisecond), TTL
60 s, a recompute takes 0.5 s. The value is computed at t = 0; the simulation runs to
the first expiry plus a margin.

- plain expiry: every request after expiry that finds no value recomputes (no
  coordination): all requests during the 0.5 s recompute miss -> ~500 recomputations.
- XFetch: each request asks ``layered_cache._xfetch.should_refresh_early`` (the library's
  own function) with delta = 0.5 s; the first "yes" starts one background refresh
  (under the lease, so only one at a time); everybody keeps getting the current value.
  Reported: recomputations, requests that had to wait, and how long before expiry the
  first refresh started (median over seeds), for beta 0.5, 1 and 2.
- fixed early TTL (cashews-style ``early_ttl``): refresh in the background once the
  value is older than a fixed fraction of the TTL (here 1/3 and 2/3 of it): never a
  stampede, but it throws away the rest of every TTL.
"""

from __future__ import annotations

import random
import time
from typing import Any

from bench.env import BenchEnv
from bench.floors import median
from bench.report import Headline, Section
from layered_cache._xfetch import should_refresh_early

RATE = 1000
TTL = 60.0
DELTA = 0.5
HORIZON = TTL + 2.0
TARGET = 2


def plain() -> dict[str, Any]:
    expiry, recomputes, waits, ready_at = TTL, 0, 0, None
    for ms in range(int(HORIZON * RATE)):
        now = ms / RATE
        if ready_at is not None and now >= ready_at:
            expiry, ready_at = ready_at + TTL, None
        if now >= expiry:
            recomputes += 1  # this request loads by itself
            waits += 1
            if ready_at is None:
                ready_at = now + DELTA
    return {"recomputes": recomputes, "waits": waits, "lead_s": 0.0}


def xfetch(beta: float, seed: int) -> dict[str, Any]:
    rand = random.Random(seed).random
    expiry, recomputes, waits, refresh_done, first = TTL, 0, 0, None, None
    for ms in range(int(HORIZON * RATE)):
        now = ms / RATE
        if refresh_done is not None and now >= refresh_done:
            expiry, refresh_done = refresh_done + TTL, None
        if refresh_done is not None:
            continue  # a refresh is running (lease held): serve the current value
        if now >= expiry:
            waits += 1
        if should_refresh_early(now, expiry, DELTA, beta, rand):
            recomputes += 1
            refresh_done = now + DELTA
            if first is None:
                first = expiry - now
    return {"recomputes": recomputes, "waits": waits, "lead_s": first or 0.0}


def fixed_early(fraction: float) -> dict[str, Any]:
    """Background refresh once the value is older than ``fraction * TTL``."""
    early_at = fraction * TTL
    per_ttl = TTL / (early_at + DELTA)
    return {"recomputes": 1, "waits": 0, "lead_s": TTL - early_at,
            "recomputes_per_hour": 3600 / (early_at + DELTA), "per_ttl": per_ttl}


async def run(env: BenchEnv) -> Section:
    started = time.perf_counter()
    section = Section("xfetch_sim", "7. Early refresh in virtual time (1,000 req/s, TTL 60 s, 0.5 s recompute)")
    seeds = 5 if env.quick else 21
    rows: dict[str, dict[str, Any]] = {"plain expiry": plain()}
    for beta in (0.5, 1.0, 2.0):
        runs = [xfetch(beta, seed) for seed in range(seeds)]
        rows[f"XFetch beta {beta:g}"] = {
            "recomputes": max(r["recomputes"] for r in runs),
            "waits": max(r["waits"] for r in runs),
            "lead_s": median([r["lead_s"] for r in runs]),
            "lead_range": (min(r["lead_s"] for r in runs), max(r["lead_s"] for r in runs)),
        }
    for fraction in (1 / 3, 2 / 3):
        rows[f"fixed early TTL at {fraction:.0%} of TTL (cashews-style)"] = fixed_early(fraction)
    section.columns = ["strategy", "recomputations around expiry", "requests that waited",
                       "first refresh before expiry", "recomputes per hour"]
    for name, r in rows.items():
        lead = f"{r['lead_s']:.2f} s"
        if "lead_range" in r:
            lead += f" ({r['lead_range'][0]:.2f}..{r['lead_range'][1]:.2f})"
        per_hour = r.get("recomputes_per_hour", 3600 / (TTL + (0 if "plain" in name else -r["lead_s"] + DELTA)))
        section.rows.append([name, str(r["recomputes"]), str(r["waits"]),
                             "-" if "plain" in name else lead, f"{per_hour:.0f}"])
    section.notes.append(
        f"XFetch rows: max recomputations / waits over {seeds} seeds, median lead time "
        "(min..max). Recomputes per hour: 3600 / (time between refreshes). A fixed early TTL "
        "refreshes at a fixed age (wasting the rest of the TTL); XFetch refreshes within the "
        "last few load times (lead ~ delta * beta * ln(rate * delta * beta))."
    )
    x1 = rows["XFetch beta 1"]
    ok = all(rows[f"XFetch beta {b:g}"]["recomputes"] <= TARGET
             and rows[f"XFetch beta {b:g}"]["waits"] == 0 for b in (0.5, 1.0, 2.0))
    section.headline.append(
        Headline(
            "Early refresh (sim, 1,000 req/s, 0.5 s recompute): recomputations at expiry",
            f"XFetch beta 1: {x1['recomputes']} (0 waits, {x1['lead_s']:.1f} s before expiry)",
            f"plain expiry {rows['plain expiry']['recomputes']}",
            f"<= {TARGET}, zero waits (beta 0.5/1/2)",
            "ok" if ok else "MISSED",
        )
    )
    section.data = {"rows": rows}
    section.seconds = time.perf_counter() - started
    return section
