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


async def test_a_batch_that_times_out_once_is_measured_again_not_the_end_of_the_scenario() -> None:
    """A floor client with a 100 ms socket timeout timed out once under a neighbour's
    load, and the exception ended the l2_hit scenario with every figure in it."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from bench.floors import interleaved

    calls = {"flaky": 0}

    async def flaky(n: int) -> float:
        calls["flaky"] += 1
        if calls["flaky"] == 3:  # the first measured batch, after the two warm-ups
            raise RedisTimeoutError("Timeout reading from socket")
        return 1e-6

    async def steady(n: int) -> float:
        return 2e-6

    retried: dict[str, int] = {}
    results = await interleaved({"flaky": flaky, "steady": steady}, 100, 3, retried=retried)
    assert results == {"flaky": [1e-6] * 3, "steady": [2e-6] * 3}
    assert retried == {"flaky": 1}
