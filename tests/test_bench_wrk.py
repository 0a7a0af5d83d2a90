"""The end-to-end benchmark's pieces that need no server: reading wrk's summary, the
Lua script that walks the hot ids, and the three ``book`` namespaces it serves."""

from __future__ import annotations

import pytest

from bench.e2e_app import book_namespace, bookstore_config
from bench.wrk import parse_wrk, round_robin_script

# wrk 4.1.0 --latency against a server answering 404 (so the non-2xx line shows),
# with a socket-errors line as wrk prints it when connections time out.
SAMPLE = """\
Running 1s test @ http://127.0.0.1:18765/nonexistent
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.10ms    4.71ms  42.23ms   93.51%
    Req/Sec     0.87k   310.53     1.20k    80.00%
  Latency Distribution
     50%  612.00us
     75%    3.30ms
     90%    6.08ms
     99%    1.20s
  871 requests in 1.01s, 442.30KB read
  Socket errors: connect 0, read 3, write 0, timeout 2
  Non-2xx or 3xx responses: 871
Requests/sec:    866.35
Transfer/sec:    439.94KB
"""


def test_the_summary_gives_rate_percentiles_in_seconds_and_errors() -> None:
    result = parse_wrk(SAMPLE)
    assert result.requests_per_s == 866.35
    assert result.requests == 871
    assert result.latency_s["50%"] == pytest.approx(612e-6)
    assert result.latency_s["90%"] == pytest.approx(6.08e-3)
    assert result.p99_s == pytest.approx(1.2)
    assert result.non_2xx == 871
    assert result.socket_errors == 5


def test_a_run_that_never_connected_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="no rate or latency"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_the_script_walks_every_path_in_turn() -> None:
    script = round_robin_script(["/books/1", "/books/2"])
    assert 'local paths = {"/books/1", "/books/2"}' in script
    assert "i = i % #paths + 1" in script


def test_only_the_book_namespace_differs_between_the_configurations() -> None:
    shipped = book_namespace("l1")
    assert book_namespace("l2") == {**shipped, "l1": False}
    assert book_namespace("db") == {"key": "book:{id}", "cache": False}
    configs = {
        mode: bookstore_config(mode, "redis://127.0.0.1:6379/0", "e2e:")
        for mode in ("l1", "l2", "db")
    }
    assert configs["l2"].namespaces["book"].l1 is False
    assert configs["db"].namespaces["book"].cache is False
    assert configs["l1"].namespaces["stock"] == configs["db"].namespaces["stock"]
    with pytest.raises(ValueError, match="E2E mode"):
        book_namespace("l3")
