"""The `layered-cache` CLI against a real Redis: subprocess and in-process `main(argv)`."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings as warnings_module
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from redis.crc import key_slot

from layered_cache._codec import Codec
from layered_cache._config import load_config
from layered_cache._warm import JsonlReader, Progress, Warmer
from layered_cache.cli import main
from tests.helpers import make_config, open_cache
from tests.servers import RedisClusterServers, RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


def write_config(tmp_path: Path, redis_url: str, prefix: str, extra: str = "") -> Path:
    path = tmp_path / "layered_cache.toml"
    path.write_text(
        f"""
[redis]
url = "{redis_url}"
prefix = "{prefix}"
# Patient: these scenarios are about the CLI, not latency; on a starved CPU (make
# test-stress) a 500 ms connect once stopped `warm` with "Redis error".
timeout = "3s"
connect_timeout = "3s"

[namespaces.book]
key = "book:{{id}}"
l2 = {{ ttl = "10m", jitter = 0.1 }}
hot = {{ replicas = 4, keys = ["book:1"] }}

[namespaces.review]
key = "review:{{book}}:{{lang}}"

[namespaces.stock]
key = "stock:{{id}}"
cache = false
{extra}
"""
    )
    return path


def run_cli(
    *args: str, cwd: Path = ROOT, repo_on_path: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("PYTHONPATH", None)
    if repo_on_path:
        env["PYTHONPATH"] = str(ROOT)
    env.pop("LAYERED_CACHE_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "layered_cache", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


@pytest.fixture
def admin(redis_url: str) -> Iterator[Any]:
    client: Any = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def envelope(value: object, soft_in: float = 300.0, delta: float = 0.25) -> bytes:
    import time

    now = time.time()
    codec: Codec[Any] = Codec()
    return codec.encode(value, now - 1.0, now + soft_in, delta)


# -- config check ----------------------------------------------------------------------


def test_config_check_prints_effective_policies(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    assert main(["config", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "OK (3 namespaces" in out
    # defaults filled in: the file gave no l1 or stampede table for book
    assert "l1: ttl=5s jitter=0.2 max_entries=10000" in out
    assert "l2: ttl=10m jitter=0.1" in out
    assert "stampede: lease_ttl=5s reread_pause=[50ms, 150ms] max_wait=3s" in out
    assert "never cached" in out  # stock

    assert "[purge] urls=[]" in out and "  tags: false" in out and "  http: off" in out

    assert main(["config", "check", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["namespaces"]["review"]["hot"] == "off"
    assert data["namespaces"]["book"]["hot"]["replicas"] == 4
    # every section and option, as the docs promise ("every default filled in")
    assert data["purge"]["retries"] == 3 and data["namespaces"]["book"]["tags"] is False


def test_config_check_bad_file_exits_2_with_the_path_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[namespaces.book]\nkey = "book:{id}"\nl2 = { ttl = "ten" }\n')
    result = run_cli("config", "check", str(bad))
    assert result.returncode == 2
    assert "namespaces.book.l2.ttl" in result.stderr and "ten" in result.stderr
    assert "Traceback" not in result.stderr
    missing = run_cli("config", "check", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_config_check_masks_the_redis_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "redis://app:s3cretpw@127.0.0.1:6379/0", "")
    assert main(["config", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "s3cretpw" not in out and "redis://***@127.0.0.1" in out


def test_config_check_shows_warnings_in_text_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each once: as a `warning:` line (or in the JSON), not also as a Python warning on
    stderr, which repeated it with a source line of the library's."""
    slow = '[namespaces.slow]\nkey = "slow:{id}"\nl1 = { ttl = "1h" }\n'
    config = write_config(tmp_path, "redis://127.0.0.1:6379/0", "", slow)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")  # any Python warning fails the test
        assert main(["config", "check", str(config)]) == 0
        out = capsys.readouterr().out
        assert "OK (4 namespaces" in out
        assert out.count("warning: ") == 1 and "namespaces.slow.l1.ttl" in out
        assert main(["config", "check", str(config), "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert len(warnings) == 1 and "l1.ttl: 3600s is longer than l2.ttl" in warnings[0]


def test_config_check_refuses_what_the_daemon_would_refuse(tmp_path: Path) -> None:
    route = '[[events]]\ntype = "A"\ninvalidate = [{ namespace = "book", key = { id = "id" } }]\n'
    config = write_config(tmp_path, "redis://127.0.0.1:6379/0", "", route + route)
    result = run_cli("config", "check", str(config))
    assert result.returncode == 2
    assert f"{config}: events[1].type: 'A' is already routed by events[0]" in result.stderr


KAFKA_SECTIONS_THE_DAEMON_CANNOT_START_WITH = {
    # aiokafka refused it at construction: daemon_crashed, a traceback, exit 1.
    "kafka.sasl_username": 'security_protocol = "SASL_PLAINTEXT"\nsasl_mechanism = "PLAIN"',
    # aiokafka's default mechanism is PLAIN: the same crash.
    "kafka.sasl_mechanism": 'security_protocol = "SASL_PLAINTEXT"',
    # create_ssl_context's FileNotFoundError was retried as a broker connect failure forever.
    "kafka.ssl_cafile": 'security_protocol = "SSL"\nssl_cafile = "/nonexistent/ca.pem"',
    # The bind failed at start: "health server can't listen on ...", exit 2.
    "kafka.health_host": 'health_host = "no such host.invalid"',
}


@pytest.mark.parametrize("field", sorted(KAFKA_SECTIONS_THE_DAEMON_CANNOT_START_WITH))
def test_config_check_refuses_a_kafka_section_the_daemon_cannot_start_with(
    tmp_path: Path, field: str
) -> None:
    """`config check` passing means the daemon starts with the file: each of these
    passed, then the daemon crashed, retried forever or exited 2 at its start."""
    kafka = KAFKA_SECTIONS_THE_DAEMON_CANNOT_START_WITH[field]
    config = write_config(tmp_path, "redis://127.0.0.1:6379/0", "", f"[kafka]\n{kafka}\n")
    result = run_cli("config", "check", str(config))
    assert result.returncode == 2, result.stdout
    assert f"{config}: {field}: " in result.stderr and "Traceback" not in result.stderr


# -- inspect / invalidate / hotkeys ----------------------------------------------------


def test_inspect_shows_ttls_replicas_lease_and_envelope(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    base = f"{prefix}book:42"
    admin.set(base, envelope({"title": "Dune"}), px=600_000)
    admin.set(f"{base}#1", envelope({"title": "Dune"}), px=590_000)
    admin.set(f"{base}#3", envelope({"title": "Dune"}), px=590_000)
    # A lease that outlives two CLI runs on a busy machine (each starts a Python).
    admin.set("{" + base + "}:lease", "tok123", px=120_000)

    result = run_cli("inspect", "book", "id=42", "--config", str(config), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["key"] == base
    assert report["base"]["exists"] and 590_000 < report["base"]["pttl_ms"] <= 600_000
    env = report["base"]["envelope"]
    assert env["fresh"] is True and env["delta_s"] == 0.25
    assert 290 < env["soft_expiry_in_s"] <= 300
    assert report["base"]["size"] > env["value_size"] > 0
    assert [r["name"] for r in report["replicas"]] == [f"{base}#1", f"{base}#3"]
    assert report["replicas_configured"] == 4
    assert report["lease"]["holder"] == "tok123" and 0 < report["lease"]["pttl_ms"] <= 120_000

    text = run_cli("inspect", "book", "id=42", "--config", str(config))
    assert text.returncode == 0, text.stderr
    assert "replicas   2/4 exist" in text.stdout
    assert "held by token tok123" in text.stdout
    assert "delta      0.2500s" in text.stdout


def test_inspect_escapes_control_characters_written_into_redis(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    """A lease token with a terminal escape and a newline cleared the operator's screen
    and printed a forged "L2 present" line."""
    config = write_config(tmp_path, redis_url, prefix)
    admin.set("{" + f"{prefix}book:8" + "}:lease", b"tok\x1b[2J\nL2         present", px=60_000)
    result = run_cli("inspect", "book", "id=8", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\\x1b" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("L2 ")] == [
        "L2         absent"
    ]


def test_inspect_absent_key_and_undecodable_value(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    admin: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    assert main(["inspect", "book", "id=7", "--config", config]) == 0
    out = capsys.readouterr().out
    assert "L2         absent" in out and "lease" in out and "free" in out
    admin.set(f"{prefix}book:8", b"\x80\x04pickle")
    assert main(["inspect", "book", "id=8", "--config", config]) == 0
    assert "not a layered_cache envelope" in capsys.readouterr().out
    tags = {f"book:{i}": "v" for i in range(1_001)}  # written before the limit, or planted
    admin.set(f"{prefix}book:9", msgspec.msgpack.encode([1, "page", 1.0, 2.0, 0.0, tags]))
    assert main(["inspect", "book", "id=9", "--config", config]) == 0
    assert "1,001 tags, more than the 1,000 an entry may carry" in capsys.readouterr().out


def test_inspect_json_of_an_absent_key_keeps_the_report_shape(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The report is a Struct: an absent key has no size/envelope, a free lease nulls.
    config = str(write_config(tmp_path, redis_url, prefix))
    assert main(["inspect", "book", "id=404", "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == [
        "namespace", "template", "key", "base", "replicas_configured", "replicas",
        "replicas_unreachable", "lease",
    ]  # fmt: skip
    assert report["base"] == {"exists": False, "pttl_ms": -2}
    lease = "{" + f"{prefix}book:404" + "}:lease"
    assert report["lease"] == {"name": lease, "holder": None, "pttl_ms": None}
    assert report["replicas"] == [] and report["replicas_unreachable"] == {}


def test_int_looking_values_become_ints_only_when_canonical(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    assert main(["inspect", "review", "book=007", "lang=en", "--config", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["key"] == f"{prefix}review:007:en"


def test_invalidate_deletes_key_replicas_and_lease(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    base = f"{prefix}book:5"
    names = [base, *(f"{base}#{i}" for i in range(4)), "{" + base + "}:lease"]
    for name in names:
        admin.set(name, b"x", px=60_000)
    result = run_cli("invalidate", "book", "id=5", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"invalidated {base}: 6 name(s) deleted" in result.stdout
    assert admin.exists(*names) == 0
    # announced on the backplane stream, so every instance drops its L1 copy
    entries = admin.xrange(f"{prefix}layered_cache:invalidations")
    assert any(base.encode() in b"".join(fields.values()) for _, fields in entries)


def test_invalidate_and_inspect_name_the_one_key_of_a_template_without_fields(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``key = "settings"`` is a valid template with one key, but the CLI took field=value
    with nargs="+": without a field argparse refused the command, and with one the
    field was unknown. An operator could not invalidate that key at all."""
    settings = '[namespaces.settings]\nkey = "settings"\n'
    config = str(write_config(tmp_path, redis_url, prefix, extra=settings))
    admin.set(f"{prefix}settings", envelope({"theme": "dark"}), px=60_000)
    assert main(["inspect", "settings", "--config", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["key"] == f"{prefix}settings"
    assert main(["invalidate", "settings", "--config", config]) == 0
    assert f"invalidated {prefix}settings" in capsys.readouterr().out
    assert admin.exists(f"{prefix}settings") == 0
    assert main(["invalidate", "settings", "id=1", "--config", config]) == 2
    assert "unknown field(s) ['id']" in capsys.readouterr().err


def test_invalidate_and_warm_with_another_replica_count_than_the_fleets_are_refused(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    """The fleet writes book:7 and its 4 replicas; a CLI whose config says no replicas
    deleted the base key only, and hot instances kept serving the old replicas after it
    reported the key invalidated (warm: wrote the base key only)."""
    fleet = write_config(tmp_path, redis_url, prefix)
    assert run_cli("invalidate", "book", "id=7", "--config", str(fleet)).returncode == 0
    base = f"{prefix}book:7"
    for name in [base, *(f"{base}#{i}" for i in range(4))]:
        admin.set(name, b"old", px=60_000)
    other = tmp_path / "other"
    other.mkdir()
    cold = write_config(other, redis_url, prefix).read_text().replace(
        'hot = { replicas = 4, keys = ["book:1"] }', ""
    )
    (other / "layered_cache.toml").write_text(cold)
    result = run_cli("invalidate", "book", "id=7", "--config", str(other / "layered_cache.toml"))
    assert result.returncode == 2 and "replicas" in result.stderr, result
    assert "Traceback" not in result.stderr
    assert admin.exists(base, *(f"{base}#{i}" for i in range(4))) == 5  # nothing half-done
    source = tmp_path / "w.jsonl"
    source.write_text('{"key": {"id": 7}, "value": "new"}\n')
    result = run_cli(
        "warm", "book", "--from", str(source), "--config", str(other / "layered_cache.toml")
    )
    assert result.returncode == 2 and "replicas" in result.stderr, result


def test_hotkeys_lists_static_keys_and_their_replicas(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    admin: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    admin.set(f"{prefix}book:1", b"x", px=60_000)
    admin.set(f"{prefix}book:1#2", b"x", px=60_000)
    assert main(["hotkeys", "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["book"]["static"] == [
        {"key": f"{prefix}book:1", "base_exists": True, "replicas_present": [2]}
    ]
    assert "review" not in report
    assert main(["hotkeys", "--config", config]) == 0
    out = capsys.readouterr().out
    assert "replicas 1/4 (#2)" in out and "running instances" in out


async def test_hotkeys_shows_keys_detected_by_running_instances(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    from layered_cache import LayeredCache, load_config

    extra = (
        '\n[namespaces.author]\nkey = "author:{id}"\nl1 = false\n'
        'hot = { replicas = 4, threshold = "20/s", window = "500ms" }\n'
    )
    path = write_config(tmp_path, redis_url, prefix, extra)
    async with LayeredCache.from_config(load_config(path, env={})) as cache:

        async def loader() -> str:
            return "Wislawa"

        async def steady_reads() -> None:  # ~100 L2 reads/s, far above 20/s
            while True:
                await cache.get_or_load("author", {"id": 7}, loader)
                await asyncio.sleep(0.01)

        reads = asyncio.create_task(steady_reads())
        await asyncio.sleep(0.6)
        assert f"{prefix}author:7" in cache.hot_keys()["author"]
        await asyncio.sleep(1.2)  # the reporter writes about once a second
        code = await asyncio.to_thread(main, ["hotkeys", "--config", str(path), "--json"])
        reads.cancel()
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    detected = report["author"]["detected"]
    assert [entry["key"] for entry in detected] == [f"{prefix}author:7"]
    assert detected[0]["rate"] > 20 and detected[0]["instances"] == 1


# -- warm ------------------------------------------------------------------------------


def test_warm_fills_with_jittered_ttls_and_shows_progress(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    source = tmp_path / "books.jsonl"
    lines = [json.dumps({"key": {"id": i}, "value": {"title": f"t{i}"}}) for i in range(200)]
    source.write_text("\n".join(lines) + "\n\n")
    result = run_cli(
        "warm", "book", "--from", str(source), "--config", str(config), "--concurrency", "8"
    )
    assert result.returncode == 0, result.stderr
    assert "warmed 200 of 200 book entries" in result.stdout
    assert "100%" in result.stderr and "200 warmed" in result.stderr  # the progress bar
    assert result.stderr.endswith("\n")  # the progress line is terminated
    ttls = [admin.pttl(f"{prefix}book:{i}") / 1000 for i in range(200)]
    assert all(540 - 5 <= ttl <= 660 for ttl in ttls)
    assert max(ttls) - min(ttls) > 10  # jittered, not one expiry for all
    raw = admin.get(f"{prefix}book:7")
    assert raw is not None
    assert Codec().decode(raw).value == {"title": "t7"}
    # the static hot key book:1 was written to its replicas too
    assert admin.exists(*(f"{prefix}book:1#{i}" for i in range(4))) == 4


def test_warm_reports_bad_lines_by_number_and_warms_the_rest(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    admin: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    big = '[namespaces.big]\nkey = "big:{id}"\nmax_value_bytes = 100\n'
    config = str(write_config(tmp_path, redis_url, prefix, extra=big))
    source = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"key": {"id": 1}, "value": 1}),
        json.dumps({"key": {"id": "a b"}, "value": 2}),  # unsafe key value
        "{not json",
        '{"value": 1}',  # no key
        json.dumps({"key": {"id": 5}, "value": "x" * 200}),  # too large for `big`
        json.dumps({"key": {"id": 6}, "value": {"url": "redis://u:s3cretpw@h:1/0"}}),
        # Python's json refuses these with ValueError/RecursionError, not JSONDecodeError:
        # the run stopped as on a read error (line 7 never listed, resumed past), or
        # ended in a traceback.
        '{"key": {"id": 7}, "value": ' + "9" * 5000 + "}",
        '{"key": {"id": 8}, "value": ' + "[" * 100_000 + "]" * 100_000 + "}",
        json.dumps({"key": {"id": 9}, "value": 9}),
    ]
    source.write_text("\n".join(lines) + "\n")
    assert main(["warm", "book", "--from", str(source), "--config", config]) == 1
    captured = capsys.readouterr()
    assert "warmed 4 of 9 book entries; 5 failed" in captured.out
    assert f"{source}:7: not valid JSON" in captured.err
    assert f"{source}:8: not valid JSON" in captured.err
    assert admin.exists(f"{prefix}book:9") == 1
    assert f"{source}:2:" in captured.err and "not a safe key value" in captured.err
    assert f"{source}:3: not valid JSON" in captured.err
    assert f"{source}:4: expected" in captured.err and '"key"' in captured.err
    assert admin.exists(f"{prefix}book:1", f"{prefix}book:5", f"{prefix}book:6") == 3

    assert main(["warm", "big", "--from", str(source), "--config", config]) == 1
    captured = capsys.readouterr()
    assert f"{source}:5: value too large" in captured.err
    assert admin.exists(f"{prefix}big:5") == 0 and admin.exists(f"{prefix}big:6") == 1


def test_warm_refuses_what_json_has_not_and_key_fields_the_template_has_not(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    admin: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Python's json took NaN, Infinity and 1e400 (stored as msgpack nan/inf), and key
    fields the template lacks were dropped: two lines differing only in one wrote the
    same key, the last one winning, and the run said all was warmed."""
    config = str(write_config(tmp_path, redis_url, prefix))
    source = tmp_path / "odd.jsonl"
    lines = [
        '{"key": {"id": 1}, "value": NaN}',
        '{"key": {"id": 2}, "value": [Infinity]}',
        '{"key": {"id": 3}, "value": 1e400}',
        '{"key": {"id": 4, "lang": "en"}, "value": "en"}',
        '{"key": {"id": 5}, "value": 1.5e300}',
    ]
    source.write_text("\n".join(lines) + "\n")
    assert main(["warm", "book", "--from", str(source), "--config", config]) == 1
    captured = capsys.readouterr()
    assert "warmed 1 of 5 book entries; 4 failed" in captured.out
    for line in (1, 2, 3):
        assert f"{source}:{line}: not valid JSON" in captured.err
    assert f"{source}:4: unknown key field(s) ['lang']" in captured.err
    assert [admin.exists(f"{prefix}book:{i}") for i in range(1, 6)] == [0, 0, 0, 0, 1]


def test_warm_lists_only_the_first_failures_and_counts_the_rest(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    source = tmp_path / "junk.jsonl"
    source.write_text("junk\n" * 25)
    assert main(["warm", "book", "--from", str(source), "--config", config]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("not valid JSON") == 10
    assert "... and 15 more failed line(s)" in captured.err
    assert "warmed 0 of 25 book entries; 25 failed" in captured.out


def test_warm_start_line_skips_the_lines_before_it(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    source = generate(tmp_path / "books.jsonl", 10)
    args = ["warm", "book", "--from", str(source), "--config", config, "--start-line", "4"]
    assert main(args) == 0
    assert "warmed 7 of 7 book entries" in capsys.readouterr().out
    assert admin.exists(*(f"{prefix}book:{i}" for i in range(1, 4))) == 0
    assert admin.exists(*(f"{prefix}book:{i}" for i in range(4, 11))) == 7


# -- warm at size and under Ctrl-C -----------------------------------------------------


def book_line(i: int, filler: int = 8) -> str:
    """Line i of a generated file (line number == id, so the resume line maps to ids)."""
    return json.dumps({"key": {"id": i}, "value": {"id": i, "title": f"title {i}" * filler}}) + "\n"


def generate(path: Path, lines: int, filler: int = 8) -> Path:
    with path.open("w") as out:
        out.writelines(book_line(i, filler) for i in range(1, lines + 1))
    return path


# Few but large lines: a 64 MB file warms in seconds. The old reader held the text, its
# lines and every parsed value at once: over 3x the file size in RSS.
BIG_LINES, BIG_FILLER = 8_000, 800
SIGINT_LINES = 10_000


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("warm") / "big.jsonl", BIG_LINES, BIG_FILLER)


@pytest.fixture(scope="module")
def sigint_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("warm") / "books.jsonl", SIGINT_LINES)


# Runs the CLI and prints the process' peak RSS (KiB on Linux) as the last stderr line.
PEAK_RSS = (
    "import resource, sys\n"
    "from layered_cache.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def peak_rss_mib(*args: str, exit_code: int = 0) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LAYERED_CACHE_REDIS_URL", None)
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *args], capture_output=True, text=True, timeout=600,
        cwd=ROOT, env=env,
    )  # fmt: skip
    assert result.returncode == exit_code, result.stderr[-2000:]
    return int(result.stderr.rsplit("maxrss", 1)[1]) / 1024


@pytest.mark.timeout(600)
def test_warm_streams_a_large_file_in_flat_memory(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, big_file: Path
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    small = generate(tmp_path / "small.jsonl", 10, BIG_FILLER)
    baseline = peak_rss_mib("warm", "book", "--from", str(small), "--config", config)
    peak = peak_rss_mib("warm", "book", "--from", str(big_file), "--config", config)
    assert big_file.stat().st_size > 60 * 2**20
    assert peak - baseline < 30, (baseline, peak)  # the old reader: +110 MB
    assert missing_ids(admin, prefix, range(1, BIG_LINES + 1)) == []


@pytest.mark.timeout(300)
def test_warm_refuses_an_oversized_line_as_it_reads_it_in_flat_memory(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    """One 100 MB line (a dump without newlines; max_value_bytes is 1 MB) was read whole,
    decoded, parsed and encoded before being refused: ~250 MB of RSS, OOM-killed in a
    small pod for a 1 GB line. Refused as read now, the lines after it still warmed."""
    config = str(write_config(tmp_path, redis_url, prefix))
    small = tmp_path / "small.jsonl"
    small.write_text(book_line(1) + book_line(2))
    baseline = peak_rss_mib("warm", "book", "--from", str(small), "--config", config)
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:  # in chunks: the test's own memory stays small too
        f.write('{"key": {"id": 3}, "value": "')
        for _ in range(100):
            f.write("x" * 1_000_000)
        f.write('"}\n' + book_line(4))
    result = run_cli("warm", "book", "--from", str(big), "--config", config)
    assert result.returncode == 1, result.stderr[-500:]
    assert f"{big}:1: line too long: over " in result.stderr
    assert "warmed 1 of 2" in result.stdout
    assert missing_ids(admin, prefix, range(4, 5)) == []
    peak = peak_rss_mib("warm", "book", "--from", str(big), "--config", config, exit_code=1)
    assert peak - baseline < 40, (baseline, peak)  # the old reader: +250 MB


def test_warm_reads_the_first_entry_of_a_file_saved_with_a_byte_order_mark(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    """PowerShell's `Out-File -Encoding utf8` and "UTF-8 with BOM" editors start the file
    with EF BB BF: line 1 was refused as `Unexpected UTF-8 BOM`, its entry never warmed."""
    config = write_config(tmp_path, redis_url, prefix)
    source = tmp_path / "bom.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + (book_line(1) + book_line(2)).encode())
    result = run_cli("warm", "book", "--from", str(source), "--config", str(config))
    assert result.returncode == 0, result.stderr[-500:]
    assert "warmed 2 of 2" in result.stdout
    assert missing_ids(admin, prefix, range(1, 3)) == []


def start_warm(config: Path, source: Path, stderr: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LAYERED_CACHE_REDIS_URL", None)
    args = ["warm", "book", "--from", str(source), "--config", str(config), *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "layered_cache", *args],
        stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True, cwd=ROOT, env=env,
    )  # fmt: skip


def wait_for_progress(stderr: Path, warmed: int, timeout: float = 60.0) -> None:
    """Until the progress line shows at least ``warmed`` entries written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = re.findall(r"(\d+) warmed", stderr.read_text())
        if counts and int(counts[-1]) >= warmed:
            return
        time.sleep(0.05)
    raise AssertionError(f"no progress past {warmed}: {stderr.read_text()[-500:]}")


def interrupt_warm(tmp_path: Path, config: Path, source: Path, signals: int) -> tuple[str, str]:
    stderr = tmp_path / f"stderr-{signals}.txt"
    process = start_warm(config, source, stderr, "--concurrency", "16")
    wait_for_progress(stderr, 1000)
    for _ in range(signals):
        process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 130, (out, stderr.read_text()[-2000:])
    return out, stderr.read_text()


def resume_line(out: str) -> int:
    match = re.search(r"stopped at line (\d+) \(SIGINT\).*--start-line (\d+)", out)
    assert match is not None, out
    assert match.group(1) == match.group(2)
    return int(match.group(1))


def missing_ids(admin: Any, prefix: str, ids: range) -> list[int]:
    pipe = admin.pipeline(transaction=False)
    for i in ids:
        pipe.exists(f"{prefix}book:{i}")
    return [i for i, found in zip(ids, pipe.execute(), strict=True) if not found]


def test_warm_stops_on_sigint_with_a_summary_and_resumes_where_it_stopped(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, sigint_file: Path
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    out, err = interrupt_warm(tmp_path, config, sigint_file, signals=1)
    stop = resume_line(out)
    assert 1000 < stop < SIGINT_LINES
    assert re.search(r"warmed \d+ of \d+ book entries read so far", out), out
    assert err.endswith("\n") and "Traceback" not in err
    assert missing_ids(admin, prefix, range(1, stop)) == []  # all before the stop line

    result = run_cli(
        "warm", "book", "--from", str(sigint_file), "--config", str(config),
        "--start-line", str(stop), "--concurrency", "32",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rest = SIGINT_LINES - stop + 1
    assert f"warmed {rest} of {rest}" in result.stdout
    assert missing_ids(admin, prefix, range(1, SIGINT_LINES + 1)) == []


def test_warm_two_sigints_cancel_in_flight_writes_without_a_traceback(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, sigint_file: Path
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    out, err = interrupt_warm(tmp_path, config, sigint_file, signals=2)
    stop = resume_line(out)
    assert "Traceback" not in err and "never retrieved" not in err, err[-2000:]
    assert missing_ids(admin, prefix, range(1, stop)) == []


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "nobook", "id=1"], "unknown namespace 'nobook'"),
        (["inspect", "review", "book=1"], "missing key field 'lang'"),
        (["inspect", "book", "id=a{b}"], "not a safe key value"),
        (["inspect", "book", "idd=1"], "unknown field(s) ['idd']"),
        (["inspect", "book", "id"], "expected field=value, got 'id'"),
        (["invalidate", "book", "id=1", "id=2"], "field 'id' given twice"),
        (["invalidate", "book"], "missing key field 'id'"),
        (["inspect", "review", "lang=en"], "missing key field 'book'"),
        (["warm", "stock", "--from", "/dev/null"], "has no L2"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    assert main([*args, "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layered-cache: error: ") and message in err, err


def test_inspect_of_a_key_of_another_redis_type_exits_2_naming_it(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # The store reads WRONGTYPE as a miss; inspect must not call such a key absent.
    config = str(write_config(tmp_path, redis_url, prefix))
    admin.rpush(f"{prefix}book:66", b"x")
    assert main(["inspect", "book", "id=66", "--config", config]) == 2
    err = capsys.readouterr().err
    assert f"layered-cache: error: {prefix}book:66 holds another Redis type" in err, err
    assert "WRONGTYPE" in err and "Traceback" not in err


def test_inspect_of_a_string_too_large_to_read_reports_it_present_and_foreign(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 3 MB string another tool wrote is over the store's read cap, a key error like
    WRONGTYPE: inspect called it another Redis type and exited 2."""
    config = str(write_config(tmp_path, redis_url, prefix))
    admin.set(f"{prefix}book:77", b"x" * 3_000_000, ex=600)
    assert main(["inspect", "book", "id=77", "--config", config]) == 0
    out = capsys.readouterr().out
    assert "3,000,000 bytes, over what a read takes" in out and "not a layered_cache envelope" in out
    admin.set(f"{{{prefix}book:77}}:lease", b"x" * 3_000_000, ex=600)  # its lease, too
    assert main(["inspect", "book", "id=77", "--config", config]) == 0
    assert "3,000,000 bytes, not a lease token" in capsys.readouterr().out


async def test_cli_key_reads_go_through_the_stores_breaker(redis_url: str, prefix: str) -> None:
    from layered_cache._l2 import L2Unavailable
    from layered_cache.cli.reads import KeyReads

    async with open_cache(make_config(redis_url, prefix)) as cache:
        reads = KeyReads(cache._store)
        assert await reads.pttl(f"{prefix}book:nope") == -2
        assert await reads.exists(f"{prefix}book:nope") is False
        assert await reads.get(f"{prefix}book:nope") is None
        for _ in range(2):  # make_config: failures = 2
            cache._store.breaker.failure()
        for read in (reads.pttl, reads.exists, reads.get):
            with pytest.raises(L2Unavailable, match="circuit breaker open"):
                await read(f"{prefix}book:nope")


def test_unreachable_redis_exits_2_without_password_or_traceback(tmp_path: Path) -> None:
    url = f"redis://app:s3cretpw@127.0.0.1:{free_port()}/0"
    config = write_config(tmp_path, url, "")
    result = run_cli("inspect", "book", "id=1", "--config", str(config))
    assert result.returncode == 2
    assert "cannot reach Redis at redis://***@127.0.0.1" in result.stderr
    assert "s3cretpw" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_usage_errors_exit_2() -> None:
    result = run_cli("inspect", "book")
    assert result.returncode == 2 and "usage:" in result.stderr


def test_bench_is_not_a_command_of_the_installed_tool(tmp_path: Path) -> None:
    # The wheel ships no bench/ package: `make bench` runs it from a source checkout.
    result = run_cli("bench", cwd=tmp_path, repo_on_path=False)
    assert result.returncode == 2
    assert "usage:" in result.stderr and "invalid choice: 'bench'" in result.stderr
    assert "bench" not in run_cli("--help", cwd=tmp_path, repo_on_path=False).stdout


def test_value_round_trip_through_warm_decodes_into_structs(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any
) -> None:
    class Book(msgspec.Struct):
        title: str

    config = write_config(tmp_path, redis_url, prefix)
    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps({"key": {"id": 99}, "value": {"title": "Emma"}}) + "\n")
    assert main(["warm", "book", "--from", str(source), "--config", str(config)]) == 0
    raw = admin.get(f"{prefix}book:99")
    assert raw is not None
    assert Codec(Book).decode(raw).value == Book("Emma")


def test_warm_stops_at_a_redis_failure_and_reports_the_line_to_resume_from(
    tmp_path: Path, redis_server: RedisServer, prefix: str, sigint_file: Path
) -> None:
    config = write_config(tmp_path, redis_server.url, prefix)
    stderr = tmp_path / "stderr.txt"
    process = start_warm(config, sigint_file, stderr, "--concurrency", "16")
    wait_for_progress(stderr, 1000)
    redis_server.kill()
    out, _ = process.communicate(timeout=60)
    err = stderr.read_text()
    assert process.returncode == 2, (out, err[-2000:])
    match = re.search(r"stopped at line (\d+) \(Redis error\)", out)
    assert match is not None, out
    failed = [int(n) for n in re.findall(rf"{re.escape(str(sigint_file))}:(\d+): Redis: ", err)]
    assert failed and min(failed) >= int(match.group(1))  # retried by the resumed run
    assert "Traceback" not in err


def test_warm_into_a_full_redis_stops_as_on_a_redis_error_and_counts_nothing_warmed(
    tmp_path: Path, redis_server: RedisServer, prefix: str
) -> None:
    """A Redis full under noeviction refuses the values, and set_many drops their keys:
    `warm` said "warmed 20 of 20" with no line listed and nothing in Redis. Now it stops
    as on a Redis error: nothing counted as warmed, the failed lines listed, the resume
    line at the first entry, exit 2."""
    client: Any = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + 200_000))
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        for i in range(1000):  # full before warm starts
            client.set(f"{prefix}other:{i}", b"x" * 10_000)
    config = write_config(tmp_path, redis_server.url, prefix)
    source = tmp_path / "books.jsonl"
    source.write_text(
        "".join(json.dumps({"key": {"id": i}, "value": {"t": "y" * 5000}}) + "\n" for i in range(20))
    )
    result = run_cli("warm", "book", "--from", str(source), "--config", str(config))
    in_redis = sum(client.exists(f"{prefix}book:{i}") for i in range(20))
    client.close()
    assert (in_redis, result.returncode) == (0, 2)
    assert "warmed 0 of 20" in result.stdout
    assert "not cached" not in result.stdout  # failures, not also "not cached by set()"
    assert "stopped at line 1 (Redis error)" in result.stdout
    assert f"{source}:1: Redis: full (maxmemory, noeviction)" in result.stderr


# -- a cluster with a dead master ------------------------------------------------------


def write_cluster_config(tmp_path: Path, url: str, seeds: str, prefix: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(
        f"""
[redis]
url = "{url}"
cluster = true
nodes = [{seeds}]
prefix = "{prefix}"
# Patient: these scenarios are about the CLI, not latency; on a starved CPU (make
# test-stress) a 500 ms connect once stopped `warm` with "Redis error".
timeout = "3s"
connect_timeout = "3s"

[namespaces.book]
key = "book:{{id}}"
hot = {{ replicas = 4 }}

[namespaces.review]
key = "review:{{id}}"
"""
    )
    return path


def slot_owners(cluster: RedisClusterServers) -> Callable[[str], str]:
    """name -> "host:port" of the master that holds its slot (from CLUSTER SLOTS)."""
    host, port = cluster.nodes[0]
    client: Any = redis.Redis(host=host, port=port)
    ranges = [(start, end, f"{node[0].decode()}:{node[1]}")
              for start, end, node, *_ in client.execute_command("CLUSTER SLOTS")]  # fmt: skip
    client.close()
    return lambda name: next(o for a, b, o in ranges if a <= key_slot(name.encode()) <= b)


@pytest.mark.cluster
def test_cli_with_a_dead_master_names_it_and_still_serves_keys_on_live_masters(
    tmp_path: Path, prefix: str
) -> None:
    # cluster-require-full-coverage no: what docs/operations.md recommends for caches.
    with RedisClusterServers(3, extra_args=["--cluster-require-full-coverage", "no"]) as cluster:
        config = write_cluster_config(
            tmp_path, cluster.url, ", ".join(f'"{h}:{p}"' for h, p in cluster.nodes), prefix
        )
        owner = slot_owners(cluster)
        stream = prefix + load_config(str(config)).backplane.stream
        # Not the node the URL names (the old message named it), nor the stream's.
        dead = next(s for s in cluster.servers[1:] if owner(stream) != f"{s.host}:{s.port}")
        dead_name = f"{dead.host}:{dead.port}"
        healthy = next(i for i in range(100) if owner(f"{prefix}review:{i}") != dead_name)
        doomed = next(i for i in range(100) if owner(f"{prefix}review:{i}") == dead_name)
        live_host, live_port = owner(f"{prefix}review:{healthy}").split(":")
        live: Any = redis.Redis(host=live_host, port=int(live_port))
        live.set(f"{prefix}review:{healthy}", envelope({"stars": 5}))
        dead.kill()
        cfg = ("--config", str(config))

        shown = run_cli("inspect", "review", f"id={healthy}", *cfg)
        assert shown.returncode == 0, shown.stderr
        assert "L2         present" in shown.stdout
        gone = run_cli("invalidate", "review", f"id={healthy}", *cfg)
        assert gone.returncode == 0, gone.stderr
        assert "1 name(s) deleted" in gone.stdout
        assert live.exists(f"{prefix}review:{healthy}") == 0
        live.close()
        # A key on a live master whose hot-key replicas are partly on the dead one.
        book = next(
            i for i in range(100)
            if owner(f"{prefix}book:{i}") != dead_name
            and any(owner(f"{prefix}book:{i}#{r}") == dead_name for r in range(4))
        )  # fmt: skip
        partial = run_cli("inspect", "book", f"id={book}", *cfg)
        assert partial.returncode == 0, partial.stderr
        assert f"(on master {dead_name}, which is down)" in partial.stdout

        failures = [
            run_cli("inspect", "review", f"id={doomed}", *cfg),
            run_cli("invalidate", "review", f"id={doomed}", *cfg),
            run_cli("hotkeys", *cfg),
            run_cli("warm", "review", "--from", "/dev/null", *cfg),
        ]
        for result in failures:
            assert result.returncode == 2, result
            assert dead_name in result.stderr.splitlines()[0]
            assert f"master {dead_name}" in result.stderr and "is down" in result.stderr
            assert "still working: `inspect` and `invalidate`" in result.stderr
            assert "cannot reach Redis at" not in result.stderr  # not the live URL's fault
            assert "Traceback" not in result.stderr
        assert "`hotkeys` needs every master" in failures[2].stderr
        assert "nothing was deleted" in failures[1].stderr


@pytest.mark.cluster
def test_cli_says_why_a_full_coverage_cluster_refuses_every_key_after_a_master_dies(
    tmp_path: Path, prefix: str
) -> None:
    with RedisClusterServers(3) as cluster:  # Redis's default: cluster-require-full-coverage yes
        seeds = ", ".join(f'"{h}:{p}"' for h, p in cluster.nodes)
        config = write_cluster_config(tmp_path, cluster.url, seeds, prefix)
        owner = slot_owners(cluster)
        dead = cluster.servers[1]
        dead_name = f"{dead.host}:{dead.port}"
        healthy = next(i for i in range(100) if owner(f"{prefix}review:{i}") != dead_name)
        live_host, live_port = cluster.nodes[0]
        live: Any = redis.Redis(host=live_host, port=live_port)
        dead.kill()
        deadline = time.monotonic() + 30
        while live.cluster("info")["cluster_state"] != "fail":  # the node timeout: 2 s
            assert time.monotonic() < deadline, "the cluster never marked itself failed"
            time.sleep(0.1)
        live.close()
        result = run_cli("inspect", "review", f"id={healthy}", "--config", str(config))
        assert result.returncode == 2, result
        assert f"master {dead_name}" in result.stderr and "cluster_state:fail" in result.stderr
        assert "cluster-require-full-coverage" in result.stderr
        assert "Traceback" not in result.stderr


class FailingFile(io.BytesIO):
    """A file whose read fails after ``good`` lines, as on an unmounted volume."""

    def __init__(self, data: bytes, good: int) -> None:
        super().__init__(data)
        self.left = good

    def readline(self, size: int | None = -1, /) -> bytes:
        if self.left == 0:
            raise OSError(5, "Input/output error")
        self.left -= 1
        return super().readline(size)


async def test_warm_stops_at_a_read_error_with_the_line_to_resume_from(
    redis_url: str, prefix: str
) -> None:
    source = FailingFile("".join(book_line(i) for i in range(1, 11)).encode(), good=4)
    async with open_cache(make_config(redis_url, prefix)) as cache:
        policy = cache.namespace("book").policy
        progress = Progress(0, "warm book", io.StringIO())
        warmer = Warmer(cache, policy, JsonlReader(source, policy), 3, progress)
        report = await warmer.run()
        assert report.stopped_by == "read error: Input/output error"
        assert (report.warmed, report.resume_line) == (4, 5)
        assert await cache.get("book", {"id": 4}) is not None


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(1000.001, "1000.001s"), (1234.567, "1234.567s"), (0.3, "300ms"), (600.0, "10m"), (5e-05, "50us")],
)
def test_config_check_shows_durations_as_loaded_not_rounded(seconds: float, shown: str) -> None:
    """Six significant digits showed `l2.ttl = "1000001ms"` as `1000s`."""
    from layered_cache.cli.common import format_duration

    assert format_duration(seconds) == shown


async def test_a_key_given_twice_in_chunks_written_concurrently_keeps_its_last_line(
    redis_url: str, prefix: str
) -> None:
    """Found by a review (2026-12-06). README (warm): "a key given twice keeps its last
    value". Two writers: the first takes lines 1-100 (99 tagged entries, one set() each,
    then target = "old"), the second line 101 (target = "new") and wrote it at once.
    Happened: the first writer's "old" landed last. Now a later line of a key waits for
    the earlier chunk's write of it."""
    config = make_config(
        redis_url,
        prefix,
        {"page": {"key": "page:{slug}", "tags": True, "l1": False}},
    )
    lines = []
    # Chunk 1 (lines 1..100): 99 tagged entries (each its own set(), one after another),
    # then "target" = "old" on line 100. Chunk 2 (line 101): "target" = "new".
    for n in range(1, 100):
        lines.append({"key": {"slug": f"p{n}"}, "value": n, "tags": [f"t:{n}"]})
    lines.append({"key": {"slug": "target"}, "value": "old"})
    lines.append({"key": {"slug": "target"}, "value": "new"})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    async with open_cache(config) as cache:
        policy = cache.namespace("page").policy
        reader = JsonlReader(io.BytesIO(data), policy)
        warmer = Warmer(cache, policy, reader, 2, Progress(0, "warm", io.StringIO()))
        report = await warmer.run()
        assert report.failed == 0 and report.warmed == 101, report
        value = await cache.get("page", {"slug": "target"})
    assert value == "new", f"line 101 gave 'new', the last line of the key; L2 holds {value!r}"


TAGGED_LIMIT = 200


def value_of_envelope_size(size: int) -> str:
    """A string whose untagged envelope is exactly ``size`` bytes."""
    codec = Codec()
    for n in range(size):
        if len(codec.encode("x" * n, 0.0, 0.0, 0.0)) == size:
            return "x" * n
    raise AssertionError(size)


def test_a_tagged_line_too_large_with_its_tags_is_reported_by_line_not_warmed(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a review (2026-12-06). docs/cli.md: a line whose value is larger than
    max_value_bytes is reported as FILE:LINE, and the limit is on the envelope as
    written, tags included. A line that fit only without its 5 tags was counted as
    warmed, then dropped by set() ("1 not cached by set()", no line named)."""
    admin = redis.Redis.from_url(redis_url)
    pages = f'[namespaces.page]\nkey = "page:{{id}}"\ntags = true\nmax_value_bytes = {TAGGED_LIMIT}\n'
    config = str(write_config(tmp_path, redis_url, prefix, extra=pages))
    source = tmp_path / "pages.jsonl"
    value = value_of_envelope_size(TAGGED_LIMIT)  # fits exactly: only its tags push it over
    tags = [f"book:{i}" for i in range(5)]
    source.write_text(json.dumps({"key": {"id": 1}, "value": value, "tags": tags}) + "\n")
    code = main(["warm", "page", "--from", str(source), "--config", config])
    captured = capsys.readouterr()
    assert admin.exists(f"{prefix}page:1") == 0  # not stored, as the limit says
    assert f"{source}:1:" in captured.err and "too large" in captured.err, captured
    assert "warmed 0 of 1 page entries; 1 failed" in captured.out, captured
    assert code == 1
    admin.close()
