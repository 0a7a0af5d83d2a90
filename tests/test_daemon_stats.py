"""The daemon's one source of counters: ``/metrics`` is rendered from ``DaemonStats``."""

from __future__ import annotations

from pathlib import Path

from layered_cache._backoff import Backoff
from layered_cache.daemon.metrics import COUNTER_METRICS, DaemonMetrics
from layered_cache.daemon.stats import COUNTERS, DaemonStats


def render(stats: DaemonStats, lag: dict[tuple[str, int], int], owned: int) -> str:
    return DaemonMetrics(stats, lambda: (lag, owned)).render().decode()


def test_metrics_read_the_stats_at_scrape_time() -> None:
    stats = DaemonStats()
    metrics = DaemonMetrics(stats, lambda: ({}, 0))
    assert "layered_cache_daemon_commits_total 0.0" in metrics.render().decode()
    stats.commits += 3  # counted once, in the struct; the next scrape sees it
    assert "layered_cache_daemon_commits_total 3.0" in metrics.render().decode()


def test_every_line_of_the_exposition() -> None:
    stats = DaemonStats(keys=5, names_deleted=7, dead_letters=2, dead_letters_rejected=1)
    stats.count_events({"BookPriceChanged": 3, "AuthorRenamed": 1})
    for seconds in (0.0005, 0.003, 0.2, 12.0):
        stats.batch_done(seconds)
    text = render(stats, {("t", 1): 0, ("t", 0): 4}, 2)
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples[:2] == [
        'layered_cache_daemon_events_total{type="BookPriceChanged"} 3.0',
        'layered_cache_daemon_events_total{type="AuthorRenamed"} 1.0',
    ]
    for line in (
        "layered_cache_daemon_keys_invalidated_total 5.0",
        "layered_cache_daemon_keys_deleted_total 7.0",
        "layered_cache_daemon_dead_letters_total 2.0",
        "layered_cache_daemon_dead_letters_rejected_total 1.0",
        'layered_cache_daemon_batch_seconds_bucket{le="0.001"} 1.0',
        'layered_cache_daemon_batch_seconds_bucket{le="0.005"} 2.0',
        'layered_cache_daemon_batch_seconds_bucket{le="10.0"} 3.0',
        'layered_cache_daemon_batch_seconds_bucket{le="+Inf"} 4.0',
        "layered_cache_daemon_batch_seconds_count 4.0",
        'layered_cache_daemon_lag{partition="0",topic="t"} 4.0',
        'layered_cache_daemon_lag{partition="1",topic="t"} 0.0',
        "layered_cache_daemon_assigned_partitions 2.0",
    ):
        assert line in samples, line
    assert stats.batches == 4 and stats.events == 4


def test_every_scalar_counter_is_exported_or_internal() -> None:
    exported = {field for _, _, field in COUNTER_METRICS}
    # events: by type; batches: the histogram's count.
    assert set(COUNTERS) == exported | {"events", "batches"}
    assert set(DaemonStats().totals()) == set(COUNTERS)


def test_backoff_doubles_to_the_cap_with_half_jitter_and_resets() -> None:
    low = Backoff(base=0.1, cap=0.5, rand=lambda: 0.0)
    assert [round(low.next_delay(), 3) for _ in range(5)] == [0.05, 0.1, 0.2, 0.25, 0.25]
    high = Backoff(base=0.1, cap=0.5, rand=lambda: 1.0)
    assert [round(high.next_delay(), 3) for _ in range(4)] == [0.1, 0.2, 0.4, 0.5]
    high.reset()
    assert high.attempt == 0 and round(high.next_delay(), 3) == 0.1


def test_one_of_each_the_daemon_has_no_wiring_backoff_or_logging_setup_of_its_own() -> None:
    """Redis clients come from clients.make_client/with_timeout, delays from
    layered_cache._backoff, logging from logs.configure_logging: no second copy."""
    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("layered_cache/daemon/*.py"), *root.glob("consumers/*.py")]
    sources.append(root / "layered_cache" / "_backplane.py")
    forbidden = (
        "from_url(",
        "redis.asyncio",
        "import random",
        "structlog.configure(",
        "basicConfig(",
        "msgspec.structs.replace(config.redis",
        "prometheus_client import Counter",
    )
    for path in sources:
        text = path.read_text()
        for needle in forbidden:
            assert needle not in text, f"{path.name}: {needle}"
    deletes = (root / "layered_cache" / "daemon" / "deletes.py").read_text()
    assert "make_client(" in deletes and "with_timeout(" in deletes
    main = (root / "layered_cache" / "daemon" / "main.py").read_text()
    assert "configure_logging(" in main
