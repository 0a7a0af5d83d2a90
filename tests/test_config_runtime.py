"""'config check OK' means it starts: a config that loads makes a cache that answers
(against a real Redis) and a daemon that constructs; one that does not load says where.
And a fill that fails never keeps its lease."""

from __future__ import annotations

import asyncio
import io
import json
import re
import tempfile
import time
import uuid
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.daemon import Daemon
from layered_cache import ConfigError, LayeredCache, load_config
from layered_cache._config import Duration, L2Config
from layered_cache._keys import lease_name, replica_record_name
from tests.helpers import CountingLoader, make_config

RUN = uuid.uuid4().hex[:6]
_VALID_DURATIONS = ["1ms", "100ms", "1s", "10m"]
_EDGE_DURATIONS = ["0s", 0, -1, 1e300, "3651d", "soon", "1ms", "1h"]
_EDGES: dict[tuple[str, ...], list[Any]] = {
    ("redis", "prefix"): [f"g{RUN}:sub:", f"g{RUN}", "layered_cache:", f"g{RUN} x:", ""],
    ("redis", "max_connections"): [-1, 0, 1],
    ("redis", "timeout"): _EDGE_DURATIONS,
    ("redis", "connect_timeout"): _EDGE_DURATIONS,
    ("redis", "nodes"): [["127.0.0.1:1"], ["nohost"], ["h:70000"]],
    ("kafka", "max_batch"): [0, 1],
    ("kafka", "health_port"): [-1, 0, 70000, -2],
    ("kafka", "security_protocol"): ["SSL", "plain", "SASL_SSL"],
    ("kafka", "auto_offset_reset"): ["latest", "first"],
    ("kafka", "session_timeout"): _EDGE_DURATIONS,
    ("kafka", "heartbeat_interval"): _EDGE_DURATIONS,
    ("kafka", "topics"): [[], [""], ["t"]],
    ("backplane", "block"): _EDGE_DURATIONS,
    ("backplane", "maxlen"): [0, 1],
    ("backplane", "stream"): ["layered_cache:x", "book:1"],
    ("logging", "level"): ["DEBUG", "loud", "warning"],
    ("logging", "format"): ["json", "xml"],
    ("namespaces", "book", "key"): [
        "book:{id}:{lang}",
        "book:{id",
        "book:{}",
        "{id}",
        "book:{id}{lang}",
    ],
    ("namespaces", "book", "l1"): [False, True, {"ttl": "1h"}, {"ttl": 0}, {"jitter": 1.5}],
    ("namespaces", "book", "l2"): [False, {"ttl": 1e300}, {"ttl": "1ms"}, {"ttl": "0s"}],
    ("namespaces", "book", "hot"): [
        True,
        {"threshold": 0},
        {"window": "0s"},
        {"replicas": 65},
        {"replicas": 1, "keys": ["book:1"]},
        {"cooldown": "0s", "threshold": "2/s"},
        {"threshold": "100/h"},
    ],
    ("namespaces", "book", "stale"): [{"max_age": 1e300}, {"max_age": "1h"}, {"max_age": -1}],
    ("namespaces", "book", "stampede"): [
        {"lease_ttl": "0s"},
        {"max_wait": "0s"},
        {"reread_pause": ["5ms", "1ms"]},
        {"retry": ["1ms", "5ms"]},
        {"retry": ["1ms", "5ms"], "reread_pause": ["1ms", "5ms"]},
        {"load_timeout": "0s"},
        {"load_timeout": "2s"},
        {"early_refresh_beta": -1},
    ],
    ("namespaces", "book", "max_value_bytes"): [-1, 0, 1],
    ("namespaces", "book", "cache"): [False],
    ("events",): [
        [{"type": "A", "invalidate": [{"namespace": "book", "key": {"id": "x"}}]}] * 2,
        [{"type": "CacheInvalidate", "invalidate": [{"namespace": "book", "key": {"id": "x"}}]}],
        [{"type": "A", "invalidate": [{"namespace": "nope", "key": {"id": "x"}}]}],
        [{"type": "A", "invalidate": []}],
        [{"type": "", "invalidate": [{"namespace": "book", "key": {"id": "x"}}]}],
    ],
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return repr(value)


def _toml(doc: dict[str, Any]) -> str:
    """Tables of scalars/inline tables, namespaces as [namespaces.X], events as [[events]]."""
    lines: list[str] = []
    for section, table in doc.items():
        if section == "namespaces":
            for name, ns in table.items():
                lines.append(f"[namespaces.{name}]")
                lines += [f"{key} = {_toml_value(value)}" for key, value in ns.items()]
        elif section == "events":
            for route in table:
                lines.append("[[events]]")
                lines += [f"{key} = {_toml_value(value)}" for key, value in route.items()]
        else:
            lines.append(f"[{section}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


@st.composite
def _configs(draw: st.DrawFn, redis_url: str) -> dict[str, Any]:
    """A valid config, then up to two edge values (some valid, most not) put in."""
    ttl = draw(st.sampled_from(_VALID_DURATIONS))
    doc: dict[str, Any] = {
        "redis": {"url": redis_url, "prefix": f"g{RUN}:", "timeout": "1s", "connect_timeout": "1s"},
        "kafka": {},
        "backplane": {"block": draw(st.sampled_from(_VALID_DURATIONS))},
        "logging": {},
        "namespaces": {"book": {"key": "book:{id}", "l2": {"ttl": ttl}}},
    }
    edits = draw(st.lists(st.sampled_from(sorted(_EDGES)), max_size=2, unique=True))
    for path in edits:
        value = draw(st.sampled_from(_EDGES[path]))
        table = doc
        for part in path[:-1]:
            table = table[part]
        table[path[-1]] = value
    return doc


_PATH = re.compile(r"^[a-z_]+(\[\d+\])?([.][a-z_0-9]+(\[\d+\])?)*: .+")


async def _answers(config: Any) -> None:
    """The cache starts, a read loads and fills, a second read hits: nothing hangs.
    Each generated config is a fleet of its own: forget what earlier examples sharing
    its prefix recorded (their hot.replicas), which would rightly refuse this one."""
    template = config.namespaces["book"].key  # book:{id} or book:{id}:{lang}
    fields = {"id": 1, "lang": "en"} if "{lang}" in template else {"id": 1}
    admin = redis.Redis.from_url(config.redis.url)
    await admin.delete(replica_record_name(config.redis.prefix))
    await admin.aclose()
    async with LayeredCache.from_config(config) as cache:
        loader = CountingLoader("v")
        assert await cache.get_or_load("book", fields, loader) == "v"
        assert await cache.get_or_load("book", fields, loader) == "v"
        await cache.invalidate("book", fields)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_config_either_fails_at_load_with_its_path_or_starts(
    redis_url: str, data: st.DataObject
) -> None:
    doc = data.draw(_configs(redis_url))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "generated.toml"
        path.write_text(_toml(doc))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = load_config(path, env={})
        except ConfigError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: ")
            assert _PATH.match(message[len(f"{path}: ") :]), message
            return
    Daemon(config)
    asyncio.run(asyncio.wait_for(_answers(config), timeout=20))


async def test_a_fill_that_redis_refuses_releases_its_lease(redis_url: str, prefix: str) -> None:
    """A TTL Redis refuses (load validation forbids it; built here past validation) must
    not leave the lease held: the next reader would wait max_wait for nothing."""
    base = make_config(
        redis_url, prefix, {"book": {"key": "book:{id}", "stampede": {"max_wait": "5s"}}}
    )
    book = msgspec.structs.replace(base.namespaces["book"], l2=L2Config(ttl=Duration(1e300)))
    config = msgspec.structs.replace(base, namespaces={"book": book})
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v")) == "v"
        assert await admin.exists(lease_name(f"{prefix}book:1")) == 0
        started = time.monotonic()
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("w")) == "w"
        assert time.monotonic() - started < 1.0
    await admin.aclose()


async def test_a_value_the_codec_cannot_hold_is_served_and_the_lease_released(
    redis_url: str, prefix: str
) -> None:
    """An int past 64 bits (msgpack's limit): served, not cached, no lease left behind."""
    config = make_config(redis_url, prefix)
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 2}, CountingLoader(2**100)) == 2**100
        assert cache.stats()["book"]["not_cached"] == 1
        assert await admin.exists(lease_name(f"{prefix}book:2"), f"{prefix}book:2") == 0
    await admin.aclose()


def test_a_config_replaced_in_code_with_overlapping_namespaces_makes_no_cache() -> None:
    """``Config`` is public, and code derives configs with ``msgspec.structs.replace`` (a
    namespace per tenant or feature flag; the CLI's own ``warm``): two namespaces that
    build one name started, and ``book_v2`` read ``book``'s values. The cache refuses
    them as load does; so does a static hot key no call can build."""
    from layered_cache import parse_config

    config = parse_config({"namespaces": {"book": {"key": "book:{id}"}}}, env={})
    book = config.namespaces["book"]
    for added in ("book:{id}", "book:v2:{id}"):
        namespaces = {**config.namespaces, "book_v2": msgspec.structs.replace(book, key=added)}
        with pytest.raises(ConfigError, match=r"namespaces\.book_v2\.key: may produce the same"):
            LayeredCache.from_config(msgspec.structs.replace(config, namespaces=namespaces))
    hot = parse_config({"namespaces": {"a": {"key": "a:{id}", "hot": {"replicas": 2}}}}, env={})
    ns = hot.namespaces["a"]
    never = msgspec.structs.replace(ns, hot=msgspec.structs.replace(ns.hot, keys=["b:1"]))
    with pytest.raises(ConfigError, match=r"namespaces\.a\.hot\.keys\[0\]: 'b:1' is not a key"):
        LayeredCache.from_config(msgspec.structs.replace(hot, namespaces={"a": never}))


@pytest.mark.parametrize("query", ["ssl_cert_reqs=none", "ssl_check_hostname=false"])
async def test_a_tls_query_option_on_a_plain_redis_url_is_refused_by_config_check(
    tmp_path: Path, redis_url: str, prefix: str, query: str
) -> None:
    """PROMISE (README.md, "Configuration reference"): "`layered-cache config check`
    passing means the cache and the daemon start with that file: every value the
    runtime would refuse, hang on, or misread is refused at load" (DESIGN.md §5 too).

    SCENARIO: `redis.url` is a plain `redis://` URL with `?ssl_cert_reqs=none` (or
    `?ssl_check_hostname=false`), e.g. a TLS URL's query kept when an environment
    switched to a plain Redis; `config check` on it, then a cache from the same file.

    WAS: `config check` printed OK, and the cache's start raised `TypeError:
    AbstractConnection.__init__() got an unexpected keyword argument 'ssl_cert_reqs'`:
    redis-py passes every query parameter as a connection keyword, and only a TLS
    connection takes these. `_config.checks` allowed them for every scheme.

    NOW: `config check` refuses the file (exit 2, naming `redis.url` and rediss://), and
    the same URL without that query starts."""
    from layered_cache.cli import main

    path = tmp_path / "layered_cache.toml"
    separator = "&" if "?" in redis_url else "?"
    doc = {
        "redis": {"url": f"{redis_url}{separator}{query}", "prefix": prefix},
        "namespaces": {"book": {"key": "book:{id}"}},
    }
    path.write_text(_toml(doc))
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = main(["config", "check", str(path)])
    assert code == 2, out.getvalue()
    assert "redis.url" in out.getvalue() and "rediss://" in out.getvalue(), out.getvalue()
    with pytest.raises(ConfigError, match=r"redis\.url: .*rediss://"):
        load_config(path, env={})
    config = make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as cache:
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v")) == "v"
