"""``python -m bench [--quick] [--only NAME ...] [--no-write]``: run the scenarios, write
the report.

With ``--only``, the report keeps the last run's other sections (each says when it was
measured), so one scenario can be re-run without re-running (and re-dating) the rest.
With ``--no-write`` (experiments) nothing in bench/results/ changes: the headline is
printed, and the plots go to a scratch directory (``BenchEnv.plots``)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
import time
import traceback

from bench.env import BenchEnv, machine_info
from bench.report import Section, headline_table, merge, write_all

SCENARIOS = [
    "l1_hit",
    "l2_hit",
    "sets",
    "wakeup",
    "memory",
    "l2_memory",
    "stampede_local",
    "stampede_procs",
    "jitter",
    "xfetch_sim",
    "hotkey",
    "invalidation",
    "fanout",
    "daemon_floor",
    "batch",
    "batch_cluster",
    "tags",
    "tag_invalidation",
    "fill_bytes",
    "failover",
    "http_gateway",
    "e2e_wrk",
]


def _quiet_logs() -> None:
    import structlog

    logging.basicConfig(level=logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer repeats (~90 s)")
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, help="run only these")
    parser.add_argument("--no-write", action="store_true", help="print; results and plots untouched")
    args = parser.parse_args(argv)
    _quiet_logs()
    env = BenchEnv(quick=args.quick, write=not args.no_write)
    sections: list[Section] = []
    started = time.perf_counter()
    try:
        env.forget_keys()  # an interrupted run's leftovers
        for name in args.only or SCENARIOS:
            t0 = time.perf_counter()
            print(f"== {name} ...", flush=True)
            try:
                module = importlib.import_module(f"bench.{name}")
                section: Section = asyncio.run(module.run(env))
            except Exception as exc:
                traceback.print_exc()
                section = Section(name, name, error=f"{type(exc).__name__}: {exc}")
                section.seconds = time.perf_counter() - t0
            finally:
                env.forget_keys()  # the next scenario starts on a Redis of its own size
            section.date = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            sections.append(section)
            print(f"   done in {section.seconds:.1f} s", flush=True)
    finally:
        env.close()
    print()
    print(headline_table(sections))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if not args.no_write:
        if args.only:
            sections = merge(sections, SCENARIOS, args.quick)
        path = write_all(sections, machine_info(), args.quick)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
