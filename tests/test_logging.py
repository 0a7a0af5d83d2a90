"""structlog configuration: JSON lines with namespace/key, key redaction, no passwords."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis
import structlog
from redis.crc import key_slot

from layered_cache import L2Unavailable, LayeredCache, parse_config
from layered_cache._config import LoggingConfig
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Store
from layered_cache._logs import (
    SALT_ENV,
    configure_logging,
    error_text,
    mask_url_credentials,
    redact_key,
    reset_logging,
)
from tests.faults.reply_delay import ReplyDelayProxy
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import RedisClusterServers, free_port


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    yield out
    reset_logging()


def json_lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


async def put_garbage(redis_url: str, key: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    await admin.set(key, b"not an envelope")
    await admin.aclose()


async def test_json_lines_carry_namespace_and_key(
    redis_url: str, prefix: str, stream: io.StringIO
) -> None:
    assert configure_logging(LoggingConfig(format="json"), stream=stream, env={}, force=True)
    assert not configure_logging(LoggingConfig(format="console"), stream=stream, env={})  # once
    await put_garbage(redis_url, f"{prefix}book:5")
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        await cache.get_or_load("book", {"id": 5}, CountingLoader("v"))
    events = [e for e in json_lines(stream) if e["event"] == "l2_value_undecodable"]
    assert events, stream.getvalue()
    event = events[0]
    assert event["namespace"] == "book" and event["key"] == f"{prefix}book:5"
    assert event["level"] == "warning" and "timestamp" in event
    assert event["logger"] == "layered_cache"


async def test_redaction_hides_the_key(redis_url: str, prefix: str, stream: io.StringIO) -> None:
    config = LoggingConfig(format="json", redact_keys=True)
    configure_logging(config, stream=stream, env={}, force=True)
    await put_garbage(redis_url, f"{prefix}book:77")
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        await cache.get_or_load("book", {"id": 77}, CountingLoader("v"))
    text = stream.getvalue()
    assert "book:77" not in text
    event = next(e for e in json_lines(stream) if e["event"] == "l2_value_undecodable")
    assert event["namespace"] == "book"
    assert event["key"] == redact_key(f"{prefix}book:77")
    assert redact_key("a") == redact_key("a") != redact_key("a", b"salt")


async def test_failing_redis_connect_logs_no_password(prefix: str, stream: io.StringIO) -> None:
    configure_logging(
        LoggingConfig(format="json", level="debug"), stream=stream, env={}, force=True
    )
    url = f"redis://app:s3cretpw@127.0.0.1:{free_port()}/0"
    config = make_config(url, prefix, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:
        for i in range(4):
            await cache.get_or_load("book", {"id": i}, CountingLoader("v"))
    # the URL (with the password) in an event or an exception message is masked too
    structlog.get_logger("test").error("connect_failed", url=url, error=ConnectionError(url))
    logging.getLogger("redis.test").error("stdlib record with %s", url)
    text = stream.getvalue()
    assert "circuit_breaker" in text  # something was logged about the failure
    assert "s3cretpw" not in text
    assert "redis://***@127.0.0.1" in text


EMAIL = "alice.customer@example.com"


async def _varnish_answering_500() -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readline() not in (b"\r\n", b"\n", b""):
                pass
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_a_failed_http_purge_logs_no_raw_key_or_tag_with_redact_keys(
    redis_url: str, prefix: str, stream: io.StringIO
) -> None:
    configure_logging(LoggingConfig(format="json", redact_keys=True), stream=stream, env={},
                      force=True)
    server = await _varnish_answering_500()
    port = server.sockets[0].getsockname()[1]
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"urls": [f"http://127.0.0.1:{port}"], "retries": 0,
                      "repeat_after": "0s", "timeout": "1s"},
            "namespaces": {
                "user": {"key": "user:{email}"},
                "orders": {"key": "orders:{email}", "tags": True},
            },
        },
        env={},
    )
    try:
        async with LayeredCache.from_config(config) as cache:
            await cache.invalidate("user", {"email": EMAIL})
            await cache.invalidate_tag(f"user:{EMAIL}")
            assert await eventually(lambda: cache.purge_stats().failed >= 2, timeout=20)
    finally:
        server.close()
    failed = [e for e in json_lines(stream) if e["event"] == "http_purge_failed"]
    assert len(failed) == 2 and all("HTTP 500" in e["error"] for e in failed), failed
    assert failed[1]["tags"] == [redact_key(f"user:{EMAIL}")]
    assert EMAIL not in stream.getvalue()


def test_a_key_quoted_in_an_error_is_logged_by_its_hash(stream: io.StringIO) -> None:
    configure_logging(LoggingConfig(format="json", redact_keys=True), stream=stream, env={},
                      force=True)
    structlog.get_logger("layered_cache").warning(
        "http_purge_failed", keys=["book:1", "book:12"], tags=[f"user:{EMAIL}"],
        error=f"ConnectionError('book:12 and user:{EMAIL} refused')",
    )
    event = json_lines(stream)[0]
    assert EMAIL not in stream.getvalue() and "book:12" not in stream.getvalue()
    assert redact_key("book:12") in event["error"] and event["tags"] == [redact_key(f"user:{EMAIL}")]


def test_console_format_and_env_override(stream: io.StringIO) -> None:
    configure_logging(LoggingConfig(format="console"), stream=stream, env={}, force=True)
    structlog.get_logger("layered_cache").warning("hello", namespace="book", key="book:1")
    line = stream.getvalue()
    assert "hello" in line and "namespace=book" in line and not line.startswith("{")
    configure_logging(
        LoggingConfig(format="console"),
        stream=stream,
        env={"LAYERED_CACHE_LOG_FORMAT": "json"},
        force=True,
    )
    stream.truncate(0)
    stream.seek(0)
    structlog.get_logger("layered_cache").warning("hello", namespace="book", key="book:1")
    assert json_lines(stream)[0]["key"] == "book:1"
    with pytest.raises(ValueError, match="format"):
        configure_logging(LoggingConfig(format="xml"), stream=stream, env={}, force=True)


def test_level_filters(stream: io.StringIO) -> None:
    configure_logging(
        LoggingConfig(format="json", level="error"), stream=stream, env={}, force=True
    )
    structlog.get_logger("layered_cache").warning("quiet")
    structlog.get_logger("layered_cache").error("loud")
    assert [e["event"] for e in json_lines(stream)] == ["loud"]


def test_mask_url_credentials() -> None:
    assert mask_url_credentials("redis://:pw@h:1/0") == "redis://***@h:1/0"
    assert mask_url_credentials("x rediss://u:p@h y") == "x rediss://***@h y"
    assert mask_url_credentials("redis://h:6379/0") == "redis://h:6379/0"


class _RefusingGateway:
    """A purger whose error names the key it failed on: the last of the batch."""

    async def purge(self, keys: Any, tags: Any) -> None:
        raise RuntimeError(f"gateway refused {keys[-1]}")

    async def aclose(self) -> None:
        pass


async def test_a_purge_error_naming_the_eighth_key_of_a_batch_logs_no_raw_key(
    redis_url: str, prefix: str, stream: io.StringIO
) -> None:
    """The line names five keys (hashed with redact_keys, also where another field
    quotes them); the purger's error naming the eighth was logged raw."""
    configure_logging(
        LoggingConfig(format="json", redact_keys=True), stream=stream, env={}, force=True
    )
    emails = [f"customer{i}@example.com" for i in range(8)]
    config = parse_config(
        {
            "redis": {"url": redis_url, "prefix": prefix, "timeout": "2s"},
            "purge": {"retries": 0, "repeat_after": "0s"},
            "namespaces": {"user": {"key": "user:{email}"}},
        },
        env={},
    )
    async with LayeredCache.from_config(config, purger=_RefusingGateway()) as cache:
        await cache.set_many("user", [({"email": email}, "v") for email in emails])
        assert await eventually(lambda: cache.purge_stats().failed >= 8, timeout=20)
    logged = stream.getvalue()
    assert '"http_purge_failed"' in logged
    assert not [email for email in emails if email in logged]


async def test_with_redact_keys_a_waiter_whose_subscription_is_slow_logs_no_raw_key(
    redis_url: str, prefix: str, late_replies: ReplyDelayProxy
) -> None:
    """A key that is customer data (an e-mail) whose lease another process holds: the
    read waits for the fill on the key's fill channel, whose confirmation comes late (a
    slow Redis). The debug event ``fill_subscribe_timeout`` named the channel,
    ``{<key>}:filled``: the raw key, which ``redact_keys`` promises never to log."""
    out = io.StringIO()
    configure_logging(
        LoggingConfig(format="json", level="debug", redact_keys=True), stream=out, env={},
        force=True,
    )
    try:
        stampede = {"max_wait": "400ms", "reread_pause": ["50ms", "100ms"]}
        config = make_config(
            late_replies.url,
            prefix,
            {"user": {"key": "user:{email}", "stampede": stampede}},
            redis={"timeout": "2s", "connect_timeout": "2s"},
        )
        admin = redis.Redis.from_url(redis_url)
        async with LayeredCache.from_config(config) as cache:
            key = cache.key("user", {"email": "alice@example.com"})
            await admin.set(lease_name(key), "another process", px=10_000)
            late_replies.match, late_replies.delay = b"SUBSCRIBE", 0.5
            await cache.get_or_load("user", {"email": "alice@example.com"}, CountingLoader("v"))
            late_replies.match = None
        await admin.aclose()
    finally:
        reset_logging()
    events = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    assert any(e["event"] == "fill_subscribe_timeout" for e in events), events
    leaking = [e for e in events if "alice@example.com" in json.dumps(e)]
    assert not leaking, f"events naming the raw key: {leaking}"


async def test_with_redact_keys_a_cancelled_invalidate_that_fails_logs_no_raw_key(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PROMISE (docs/metrics.md, "Logs"; layered_cache/_logs.py module doc): with
    `logging.redact_keys = true` "the key itself (an e-mail, a user id) never reaches the
    log".

    SCENARIO: a cache on a 3-master Redis Cluster, JSON logs with `redact_keys`. The
    master owning `user:{email}` is SIGKILLed. `invalidate("user", {"email": secret})` is
    cancelled (a request's deadline) while its delete is held at a gate on
    `L2Store.delete_in_order`; the delete then finishes in the background
    (`BackgroundTasks.to_completion`) and fails against the dead master.

    WAS: `background_step_failed_after_its_caller_left` logged redis-py's message,
    `L2Unavailable: ConnectionError: Command # 1 (DEL {<prefix>user:<e-mail>}:lease) of
    pipeline caused error: ...`, the e-mail in clear: `_runtime._log_orphan_failure`
    logged the exception's text, and the event has no `key` field to hash.

    NOW: the library logs exceptions through `_logs.error_text`, which `redact_keys`
    shows as the exception's types only (as the daemon's `RedisRetrier` does)."""
    secret = "user.0@example.com"  # a key field value: a customer e-mail
    out = io.StringIO()
    with RedisClusterServers(3) as cluster:
        config = make_config(
            cluster.url,
            prefix,
            {"user": {"key": "user:{email}", "l1": False}},
            redis={"cluster": True, "timeout": "1s", "breaker": {"failures": 50, "reset": "5s"}},
            logging={"format": "json", "redact_keys": True},
        )
        configure_logging(config.logging, stream=out, env={SALT_ENV: "pepper"}, force=True)
        try:
            async with LayeredCache.from_config(config) as cache:
                client: Any = cache._rt.store.client  # type: ignore[attr-defined]
                lease = f"{{{prefix}user:{secret}}}:lease"
                owner = client.nodes_manager.slots_cache[key_slot(lease.encode())][0]
                dead = next(s for s in cluster.servers if s.port == owner.port)
                gate, reached = asyncio.Event(), asyncio.Event()
                original = L2Store.delete_in_order

                async def gated(self: L2Store, groups: Any) -> int:
                    reached.set()
                    await gate.wait()  # until the caller's cancel has landed
                    return await original(self, groups)

                monkeypatch.setattr(L2Store, "delete_in_order", gated)
                dead.kill()
                request = asyncio.create_task(cache.invalidate("user", {"email": secret}))
                await asyncio.wait_for(reached.wait(), 5)
                request.cancel()  # the request's deadline
                with pytest.raises(asyncio.CancelledError):
                    await request
                gate.set()
                logged = "background_step_failed_after_its_caller_left"
                assert await eventually(lambda: logged in out.getvalue(), timeout=10)
        finally:
            reset_logging()
    event = next(e for e in json_lines(out) if e["event"] == logged)
    assert event["error"].startswith("L2Unavailable"), event
    leaked = [line for line in out.getvalue().splitlines() if secret in line]
    assert not leaked, leaked[0][:600]


def _failed_delete() -> Exception:
    """An L2Unavailable raised from redis-py's cluster-pipeline error, which quotes the
    command and its key, as a dead master's delete raises it."""
    quoted = f"Command # 1 (DEL {{p:user:{EMAIL}}}:lease) of pipeline caused error: refused"
    try:
        try:
            raise redis.ConnectionError(quoted)
        except redis.ConnectionError as exc:
            raise L2Unavailable(f"ConnectionError: {quoted}") from exc
    except L2Unavailable as exc:
        return exc


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_with_redact_keys_an_exception_is_logged_by_its_types_only(
    stream: io.StringIO, fmt: str
) -> None:
    """Besides the orphan delete above, every library event that logged an exception's
    text (a listener's or a reporter's bug with its traceback, a refused cluster
    refresh, a key's error, ...) could quote a key no `key` field names. With
    `redact_keys`, `error_text(exc)`, the exception itself and `exc_info` all show the
    types only, and an event's own f-string of the exception is withheld beside its
    traceback (`backplane_listener_error` logs `error=f"{type(exc).__name__}: {exc}"`);
    without `redact_keys` the text is kept."""
    exc = _failed_delete()
    log = structlog.get_logger("layered_cache")
    configure_logging(LoggingConfig(format=fmt, redact_keys=True), stream=stream, env={},
                      force=True)  # fmt: skip
    log.warning("cluster_refresh_failed", error=error_text(exc))
    log.warning("raw", error=exc)
    log.error("backplane_listener_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    text = stream.getvalue()
    assert EMAIL not in text and "Command # 1" not in text, text
    assert text.count("L2Unavailable: ConnectionError") >= 3, text
    assert "test_logging.py" in text and "_failed_delete" in text  # the frames are kept
    configure_logging(LoggingConfig(format=fmt), stream=stream, env={}, force=True)
    log.warning("cluster_refresh_failed", error=error_text(exc))
    assert f"L2Unavailable: ConnectionError: Command # 1 (DEL {{p:user:{EMAIL}" in (
        stream.getvalue()[len(text) :]
    )


_EMAIL = "alice.customer@example.com"


class _User(msgspec.Struct):
    email: str
    age: int

    def __post_init__(self) -> None:
        if self.age < 0:  # the application's own check, naming the record it refuses
            raise ValueError(f"user {self.email}: age must be >= 0")


async def test_with_redact_keys_a_value_that_does_not_decode_as_its_type_logs_no_raw_key(
    redis_url: str, prefix: str
) -> None:
    """docs/metrics.md ("Logs", redact_keys): an exception "is logged by its types
    only". A set() of a value that encodes but doesn't decode as its type (the app's
    `__post_init__` refusing it, naming the user) logged `value_not_decodable` with the
    message, the e-mail in clear: the write path logged its own f-string, not
    ``error_text`` (the read path did)."""
    out = io.StringIO()
    config = make_config(
        redis_url,
        prefix,
        {"user": {"key": "user:{email}"}},
        logging={"format": "json", "redact_keys": True},
    )
    configure_logging(config.logging, stream=out, env={SALT_ENV: "pepper"}, force=True)
    try:
        async with LayeredCache.from_config(config, value_types={"user": _User}) as cache:
            value: Any = {"email": _EMAIL, "age": -1}
            await cache.set("user", {"email": _EMAIL}, value)
    finally:
        reset_logging()
    text = out.getvalue()
    assert "value_not_decodable" in text, text
    leaked = [line for line in text.splitlines() if _EMAIL in line]
    assert not leaked, leaked[0][:600]
