"""The bench runner's cleanup between scenarios (``bench/env.py``)."""

from __future__ import annotations

import pytest
import redis

from bench.env import BenchEnv
from tests.servers import RedisServer


def test_the_runner_deletes_every_bench_key_and_nothing_else(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scenario's ~300,000 values must not slow the next one's writes: every
    ``bench-`` key goes between scenarios, and only those (the Redis may be shared).
    A Redis of the test's own: other tests' bench runs use the suite's."""
    redis_url = redis_server.url
    monkeypatch.setenv("REDIS_URL", redis_url)
    bench_prefix = f"bench-sets-{prefix}"
    with redis.Redis.from_url(redis_url) as client:
        client.mset({f"{bench_prefix}{i}": b"x" for i in range(25_000)})
        client.set(f"{prefix}mine", b"kept")
        assert BenchEnv(quick=True).forget_keys() >= 25_000
        assert client.exists(f"{bench_prefix}0", f"{bench_prefix}24999") == 0
        assert client.get(f"{prefix}mine") == b"kept"
        client.delete(f"{prefix}mine")


def test_a_run_that_writes_no_results_draws_its_plots_outside_bench_results() -> None:
    """``python -m bench --only jitter --no-write`` used to rewrite the committed
    ``bench/results/expiry_histogram.png``: the plots ignored ``--no-write``. Every
    scenario now draws at ``env.plot_path`` (matplotlib is the bench extra's: not
    drawn here)."""
    from bench.report import RESULTS

    scratch = BenchEnv(quick=True, write=False).plot_path("expiry_histogram.png")
    assert RESULTS not in scratch.parents and scratch.parent.is_dir()
    assert BenchEnv(quick=True).plot_path("expiry_histogram.png").parent == RESULTS
