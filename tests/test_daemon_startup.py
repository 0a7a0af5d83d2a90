"""The daemon's start-up, health endpoint, entry point and logging (issue 11).

Against the real broker and as an operator runs it: ``layered-cache daemon --config FILE``
in its own process, with the config's ``logging`` table and LAYERED_CACHE_LOG_* overrides.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import structlog
from aiokafka.structs import TopicPartition

from layered_cache import LayeredCache, ReplicaCountMismatch
from layered_cache._config import Config
from layered_cache._keys import replica_names
from layered_cache._logs import (
    FORMAT_ENV,
    SALT_ENV,
    configure_logging,
    redact_key,
    reset_logging,
)
from layered_cache.daemon import Daemon
from layered_cache.daemon.core import DaemonStartError
from layered_cache.daemon.main import setup_logging
from tests.helpers import eventually, make_config
from tests.servers import KafkaBroker, RedisClusterServers, RedisServer, create_topic, free_port
from tests.test_daemon import (
    ROOT,
    ROUTES,
    committed,
    daemon_config,
    existing,
    http_get,
    logged,
    price_changed,
    producer,
    read_all,
    running,
    seed,
    write_config,
)

pytestmark = pytest.mark.kafka


def layered_cache_command() -> list[str]:
    """The installed console script, as an operator runs it."""
    script = Path(sys.executable).parent / "layered-cache"
    found = str(script) if script.exists() else shutil.which("layered-cache")
    assert found, "the layered-cache console script is not installed"
    return [found, "daemon"]


def config_file(path: Path, config: Config, *, kafka_extra: str = "", logging: str = "") -> Path:
    """write_config's TOML with extra [kafka] lines and another [logging] table."""
    write_config(path, config, '[namespaces.book]\nkey = "book:{id}"')
    text = path.read_text()
    if kafka_extra:
        text = text.replace("health_port = -1\n", f"health_port = -1\n{kafka_extra}\n")
    if logging:
        text = text.replace('[logging]\nformat = "json"\n', f"[logging]\n{logging}\n")
    path.write_text(text)
    return path


@contextlib.contextmanager
def daemon_cli(
    args: list[str], log: Path, *, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    environ = {**os.environ, **(env or {})}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*layered_cache_command(), *args], cwd=cwd, env=environ, stdout=out, stderr=out
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- start-up and health -------------------------------------------------------------------


async def test_unreachable_broker_at_start_is_retried_and_readyz_turns_ready_once_connected(
    redis_url: str, prefix: str, unique_topic: str, redis_client: aioredis.Redis
) -> None:
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    config = daemon_config(redis_url, prefix, bootstrap, unique_topic, retry_max_backoff="300ms")
    daemon = Daemon(config, health_port=0)
    task = asyncio.create_task(daemon.run())
    try:
        assert await eventually(lambda: daemon.stats.connect_retries >= 3, timeout=20)
        assert not task.done()  # the old daemon exited here with a traceback
        assert daemon.health is not None and daemon.health.bound_port
        health = daemon.health.bound_port
        status, body = await http_get(health, "/readyz")
        assert status == 503 and msgspec.json.decode(body)["retrying"] == "connect"
        assert (await http_get(health, "/healthz"))[0] == 200
        assert "layered_cache_daemon_connect_retries_total" in (await http_get(health, "/metrics"))[1].decode()

        with KafkaBroker(port=port):
            await create_topic(bootstrap, unique_topic, 1)
            assert await eventually(lambda: bool(daemon.assignment), timeout=30)

            async def ready() -> bool:
                return (await http_get(health, "/readyz"))[0] == 200

            assert await eventually(ready, timeout=10)
            await seed(redis_client, [f"{prefix}book:5"])
            async with producer(bootstrap) as p:
                await p.send_and_wait(unique_topic, price_changed(5), partition=0)

            async def gone() -> bool:
                return await existing(redis_client, [f"{prefix}book:5"]) == []

            assert await eventually(gone, timeout=15)
            daemon.stop()
            await asyncio.wait_for(task, 20)
    finally:
        daemon.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 20)


async def test_stop_while_the_broker_is_unreachable_ends_the_daemon_cleanly(
    redis_url: str, prefix: str, unique_topic: str
) -> None:
    config = daemon_config(redis_url, prefix, f"127.0.0.1:{free_port()}", unique_topic)
    daemon = Daemon(config)
    task = asyncio.create_task(daemon.run())
    assert await eventually(lambda: daemon.stats.connect_retries >= 1, timeout=20)
    daemon.stop()
    await asyncio.wait_for(task, 10)
    assert not daemon.started.is_set()


async def test_a_daemon_started_while_redis_was_down_stops_on_another_replica_count_before_it_commits(
    prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """The fleet writes 8 replicas per hot key; a daemon configured with 2 starts while
    Redis is down (a fleet coming up: Redis may follow the daemon). It started
    unchecked and never checked again: at the first event it deleted book:1 and
    replicas #0 and #1 and committed, replicas #2..#7 served the old value for their
    TTL. It now checks before its first delete and stops with ReplicaCountMismatch."""
    server = RedisServer()
    server.start()
    try:
        server.stop()  # Redis is down while the daemon starts
        await create_topic(kafka_bootstrap, unique_topic, 1)
        daemon_namespaces = {"book": {"key": "book:{id}", "hot": {"replicas": 2}}}
        config = daemon_config(
            server.url, prefix, kafka_bootstrap, unique_topic, namespaces=daemon_namespaces
        )
        daemon = Daemon(config)
        task = asyncio.create_task(daemon.run())
        try:
            assert await eventually(lambda: bool(daemon.assignment), timeout=20)
            server.start()
            fleet = {"book": {"key": "book:{id}", "hot": {"replicas": 8}}}
            async with LayeredCache.from_config(make_config(server.url, prefix, fleet)):
                pass  # the fleet records its count
            key = f"{prefix}book:1"
            names = [key, *replica_names(key, 8)]
            client = aioredis.Redis.from_url(server.url)
            try:
                for name in names:
                    await client.set(name, b"old", ex=600)
                async with producer(kafka_bootstrap) as p:
                    await p.send_and_wait(unique_topic, price_changed(1), partition=0)
                done, _ = await asyncio.wait({task}, timeout=20)
                assert done, "the daemon went on with another replica count"
                assert await existing(client, names) == names  # nothing deleted
            finally:
                await client.aclose()
            with pytest.raises(ReplicaCountMismatch, match=r"hot\.replicas = 2 here, 8"):
                task.result()
            tp = TopicPartition(unique_topic, 0)
            assert (await committed(kafka_bootstrap, config.kafka.group_id, [tp]))[0] == 0
        finally:
            daemon.stop()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("kafka", "expected"),
    [
        ({"security_protocol": "SSL", "ssl_cafile": "/nonexistent/ca.pem"}, r"kafka\.ssl_cafile: "),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}, r"kafka\.sasl_username: "),
    ],
)
async def test_kafka_settings_no_retry_fixes_refuse_to_start_instead_of_retrying(
    redis_url: str, prefix: str, unique_topic: str, kafka: dict[str, str], expected: str
) -> None:
    """create_ssl_context's FileNotFoundError is an OSError: it was retried as a broker
    connect failure forever (/readyz said "connect"). SASL PLAIN without credentials
    crashed with aiokafka's ValueError and a traceback (exit 1)."""
    bootstrap = f"127.0.0.1:{free_port()}"
    daemon = Daemon(daemon_config(redis_url, prefix, bootstrap, unique_topic, **kafka))
    with pytest.raises(DaemonStartError, match=expected):
        await asyncio.wait_for(daemon.run(), 10)
    assert daemon.stats.connect_retries == 0


@pytest.mark.kafka
async def test_a_new_group_under_auto_offset_reset_none_stops_with_the_setting_named(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """README: `none` is a valid `kafka.auto_offset_reset`. A group that never committed
    (or whose offset retention removed) has no position under it: the daemon crashed
    with aiokafka's bare NoOffsetForPartitionError and a traceback (exit 1, as a bug)."""
    await create_topic(kafka_bootstrap, unique_topic, 1)
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic, auto_offset_reset="none")
    daemon = Daemon(config)
    with pytest.raises(DaemonStartError, match=r'auto_offset_reset = "none": no position'):
        await asyncio.wait_for(daemon.run(), 20)


async def test_health_server_binds_the_configured_host_only(
    redis_url: str, prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    await create_topic(kafka_bootstrap, unique_topic, 1)
    config = daemon_config(
        redis_url, prefix, kafka_bootstrap, unique_topic, health_host="127.0.0.2"
    )
    daemon = Daemon(config, health_port=0)
    async with running(daemon):
        assert daemon.health is not None and daemon.health.bound_port
        port = daemon.health.bound_port
        reader, writer = await asyncio.open_connection("127.0.0.2", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
        await _not_served_on("127.0.0.1", port)


async def _not_served_on(host: str, port: int) -> None:
    """Nothing listens on ``host:port``, or something else does: the same port number on
    another address may belong to another process (a parallel test worker's server)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except OSError:
        return
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(64), 5)
    except (OSError, TimeoutError):
        return
    finally:
        writer.close()
    assert not reply.startswith(b"HTTP/1.1 200"), reply


def test_health_port_already_in_use_is_a_one_line_error_and_exit_2(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    config = daemon_config(redis_url, prefix, "127.0.0.1:1", "t")
    path = config_file(tmp_path / "c.toml", config, kafka_extra='health_host = "127.0.0.1"')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*layered_cache_command(), "--config", str(path), "--health-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "already in use" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert "Traceback" not in done.stdout + done.stderr


# -- entry point ---------------------------------------------------------------------------


def test_layered_cache_daemon_with_a_bad_config_is_a_one_line_error_and_exit_2(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[kafka]\nmax_batch = "lots"\n')
    done = subprocess.run(
        [*layered_cache_command(), "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "kafka.max_batch" in lines[0], done.stderr


async def test_layered_cache_daemon_runs_beside_a_users_own_consumers_package(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """A service whose own package is called ``consumers`` (common in Kafka services; one
    is on PyPI too) runs the daemon from its own directory, its package first on the path."""
    service = tmp_path / "service"
    (service / "consumers").mkdir(parents=True)
    (service / "consumers" / "__init__.py").write_text(
        'raise ImportError("the service\'s own consumers package was imported")\n'
    )
    (service / "consumers" / "__main__.py").write_text("raise SystemExit(99)\n")
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    path = config_file(service / "layered_cache.toml", config)
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await seed(redis_client, [f"{prefix}book:11"])
    log = tmp_path / "daemon.log"
    env = {"PYTHONPATH": str(service)}
    with daemon_cli(["--config", str(path)], log, cwd=service, env=env) as proc:
        assert await eventually(
            lambda: bool(logged(log, "partitions_assigned")) or proc.poll() is not None,
            timeout=30,
        )
        assert proc.poll() is None, log.read_text()
        async with producer(kafka_bootstrap) as p:
            await p.send_and_wait(unique_topic, price_changed(11), partition=0)

        async def gone() -> bool:
            return await existing(redis_client, [f"{prefix}book:11"]) == []

        assert await eventually(gone, timeout=15)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert "own consumers package" not in log.read_text()


def test_the_library_never_imports_the_consumers_shim_and_the_wheel_leaves_it_out() -> None:
    import tomllib

    for source in (ROOT / "layered_cache").rglob("*.py"):
        text = source.read_text()
        assert "import consumers" not in text and "from consumers" not in text, source
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert find["packages"]["find"]["include"] == ["layered_cache*"]


# -- logging -------------------------------------------------------------------------------


def test_daemon_log_format_follows_the_logging_table_then_env_then_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_line(config: Config, flag: str | None) -> str:
        setup_logging(config, flag)
        structlog.get_logger("layered_cache.daemon").warning("probe", key="book:42")
        return capsys.readouterr().out.strip()

    try:
        console = make_config("redis://127.0.0.1:1/0", "", logging={"format": "console"})
        monkeypatch.delenv(FORMAT_ENV, raising=False)
        line = one_line(console, None)
        assert "probe" in line and not line.startswith("{")
        monkeypatch.setenv(FORMAT_ENV, "json")
        assert json.loads(one_line(console, None))["event"] == "probe"
        assert not one_line(console, "console").startswith("{")  # the flag wins
        redacted = make_config(
            "redis://127.0.0.1:1/0", "", logging={"format": "json", "redact_keys": True}
        )
        entry = json.loads(one_line(redacted, None))
        assert entry["key"].startswith("h:") and "book:42" not in json.dumps(entry)
        quiet = make_config("redis://127.0.0.1:1/0", "", logging={"level": "error"})
        assert one_line(quiet, None) == ""
    finally:
        reset_logging()


async def test_with_redact_keys_no_log_line_or_dlq_reason_carries_a_raw_key_value(
    redis_url: str,
    prefix: str,
    kafka_bootstrap: str,
    unique_topic: str,
    redis_client: aioredis.Redis,
    tmp_path: Path,
) -> None:
    secrets = ["alice@example.com x", "bob's card 4111"]
    config = daemon_config(redis_url, prefix, kafka_bootstrap, unique_topic)
    path = config_file(
        tmp_path / "c.toml",
        config,
        logging='format = "console"\nlevel = "debug"\nredact_keys = true',
    )
    await create_topic(kafka_bootstrap, unique_topic, 1)
    await create_topic(kafka_bootstrap, config.kafka.dead_letter_topic, 1)
    await seed(redis_client, [f"{prefix}book:21"])
    log = tmp_path / "daemon.log"
    env = {FORMAT_ENV: "json", SALT_ENV: "pepper"}  # the env wins over format = "console"
    messages: list[Any] = [
        {"type": "CacheInvalidate", "namespace": "book", "keys": [{"id": secrets[0]}]},
        {"type": "BookPriceChanged", "book_id": secrets[1], "old_price": "1", "new_price": "2"},
    ]
    with daemon_cli(["--config", str(path)], log, env=env) as proc:
        assert await eventually(lambda: bool(logged(log, "partitions_assigned")), timeout=30)
        async with producer(kafka_bootstrap) as p:
            for message in messages:
                await p.send_and_wait(unique_topic, msgspec.json.encode(message), partition=0)
            await p.send_and_wait(unique_topic, price_changed(21), partition=0)
        assert await eventually(lambda: len(logged(log, "event_dead_lettered")) == 2, timeout=15)
        assert await eventually(lambda: len(logged(log, "batch_done")) >= 1, timeout=15)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), lines[:3]
    dead = await read_all(kafka_bootstrap, config.kafka.dead_letter_topic, 2)
    reasons = [dict(m.headers)["dlq.reason"].decode() for m in dead]
    for secret in secrets:
        assert secret not in text
        assert not any(secret in reason for reason in reasons), reasons
    assert redact_key(secrets[0], b"pepper") in reasons[0]
    assert redact_key(secrets[1], b"pepper") in reasons[1]


async def test_with_redact_keys_no_raw_key_reaches_the_log_while_a_cluster_master_is_down(
    prefix: str, kafka_bootstrap: str, unique_topic: str
) -> None:
    """In a cluster the deletes go as a cluster pipeline, and redis-py's error for a
    pipeline that lost its node quotes the command with its arguments (``Command # 2
    (DEL {p:book:52}:lease) of pipeline caused error``): every invalidate_failed_retrying
    line carried raw keys (an e-mail, a user id), in the incident whose logs are read."""
    secrets = [f"user.{i}@example.com" for i in range(30)]
    out = io.StringIO()
    with RedisClusterServers(3) as cluster:
        await create_topic(kafka_bootstrap, unique_topic, 1)
        kafka = msgspec.structs.asdict(
            daemon_config(cluster.url, prefix, kafka_bootstrap, unique_topic).kafka
        )
        config = make_config(
            cluster.url,
            prefix,
            {"book": {"key": "book:{id}", "hot": {"replicas": 2}}},
            redis={"cluster": True, "timeout": "1s"},
            kafka=kafka,
            events=ROUTES,
            logging={"format": "json", "redact_keys": True},
        )
        configure_logging(config.logging, stream=out, env={SALT_ENV: "pepper"}, force=True)
        try:
            daemon = Daemon(config)
            async with running(daemon):
                cluster.servers[1].kill()  # a master, a third of the slots
                async with producer(kafka_bootstrap) as p:
                    for secret in secrets:  # some keys hash to the dead master's slots
                        book = msgspec.json.encode({"type": "BookPriceChanged", "book_id": secret})
                        await p.send(unique_topic, book, partition=0)
                    await p.flush()
                assert await eventually(lambda: daemon.stats.redis_retries >= 3, timeout=20)
        finally:
            reset_logging()
    text = out.getvalue()
    assert "invalidate_failed_retrying" in text
    leaked = [line for line in text.splitlines() if any(s in line for s in secrets)]
    assert not leaked, leaked[:1]


@pytest.mark.parametrize("port", ["70000", "-5"])
def test_a_health_port_out_of_range_is_a_usage_error(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """70000 crashed the daemon with OverflowError from bind(); -5 was accepted."""
    from layered_cache.daemon.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", "unused.toml", "--health-port", port])
    assert exit_.value.code == 2
    assert "--health-port" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "-5", "http"])
def test_a_health_port_out_of_range_is_a_usage_error_from_the_cli_too(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``layered-cache daemon`` took any integer: 99999 crashed with OverflowError and a
    traceback from bind()."""
    from layered_cache.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["daemon", "--config", "unused.toml", "--health-port", port])
    assert exit_.value.code == 2
    assert "--health-port: must be -1 (off)" in capsys.readouterr().err
