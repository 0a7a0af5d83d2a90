"""The Django namespace as a user declares it (docs/django.md, Configuration and
Timeouts): declared to tune it, it keeps the backend's defaults for what it leaves out,
so Django's timeouts stay exact; what the backend can't honour is refused by name."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests import djangoconf

djangoconf.configure()

from layered_cache import ConfigError  # noqa: E402
from layered_cache._django_setup import close_shared  # noqa: E402
from layered_cache.django import LayeredCacheBackend  # noqa: E402


@pytest.fixture(autouse=True)
def _close_shared() -> Iterator[None]:
    yield
    close_shared()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _backend(
    redis_url: str, prefix: str, namespaces: dict[str, Any], **options: Any
) -> LayeredCacheBackend:
    config = {
        "redis": {"url": redis_url, "prefix": prefix, "timeout": "3s", "connect_timeout": "3s"},
        "namespaces": namespaces,
    }
    return LayeredCacheBackend("", {"OPTIONS": {"config": config, **options}})


def _ttls(client: redis.Redis, prefix: str, names: list[str]) -> list[float]:
    return [client.pttl(f"{prefix}django:/1/{name}") / 1000 for name in names]


def test_declaring_the_namespace_for_its_l1_size_leaves_django_timeouts_alone(
    redis_url: str, prefix: str, redis_client: redis.Redis
) -> None:
    """Declared for its L1 size alone, the namespace got the schema's L2 (600 s, 10 %
    jitter): ``timeout=None`` died after ~10 minutes, 590 s after as little as 540."""
    tuned = {"django": {"key": "django:{key}", "l1": {"max_entries": 50_000}}}
    cache = _backend(redis_url, prefix, tuned)
    for i in range(10):
        cache.set(f"forever{i}", 1, timeout=None)
        cache.set(f"hour{i}", 1, timeout=3600)
        cache.set(f"almost{i}", 1, timeout=590)
    forever = _ttls(redis_client, prefix, [f"forever{i}" for i in range(10)])
    hour = _ttls(redis_client, prefix, [f"hour{i}" for i in range(10)])
    almost = _ttls(redis_client, prefix, [f"almost{i}" for i in range(10)])
    assert min(forever) > 30 * 86400, f"timeout=None expires in {min(forever):.0f} s"
    assert min(hour) > 3590, f"timeout=3600 expires in {min(hour):.0f} s"
    assert min(almost) > 589, f"timeout=590 expires in {min(almost):.0f} s"


@pytest.mark.parametrize("jitter", [None, 0.1])
def test_a_declared_l2_ttl_caps_a_timeout_at_it_not_below_it(
    redis_url: str, prefix: str, redis_client: redis.Redis, jitter: float | None
) -> None:
    """The cap was the jittered draw: a 3500 s timeout under ``l2.ttl = "1h"`` died
    after as little as 3240 s; one over the cap must end at the cap itself."""
    l2: dict[str, Any] = {"ttl": "1h"} if jitter is None else {"ttl": "1h", "jitter": jitter}
    cache = _backend(redis_url, prefix, {"django": {"key": "django:{key}", "l2": l2}})
    for i in range(20):
        cache.set(f"k{i}", 1, timeout=3500)  # within the 1 h cap: exact
        cache.set(f"long{i}", 1, timeout=7200)  # over it: capped at 1 h
    within = _ttls(redis_client, prefix, [f"k{i}" for i in range(20)])
    over = _ttls(redis_client, prefix, [f"long{i}" for i in range(20)])
    assert min(within) > 3499, f"a 3500 s timeout under a 1 h l2.ttl expires in {min(within):.0f} s"
    assert min(over) > 3599 and max(over) <= 3600, f"a 7200 s timeout capped at {over}"


@pytest.mark.parametrize("setting", ["l2", "cache"])
def test_a_django_namespace_without_redis_is_refused_naming_the_setting(
    redis_url: str, prefix: str, setting: str
) -> None:
    """With ``l2 = false``, add/incr/touch read the key from Redis, where such a
    namespace never writes: ``add`` of a present key returned True and overwrote it (an
    add-based lock admitted every caller), ``incr`` of a key ``get`` saw raised."""
    local_only = {"django": {"key": "django:{key}", setting: False}}
    cache = _backend(redis_url, prefix, local_only)
    expected = f"<CACHES OPTIONS>: namespaces.django.{setting}: "
    with pytest.raises(ConfigError, match=re.escape(expected) + ".*needs L2"):
        cache.set("lock", "first", 60)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        cache.add("lock", "second", 60)  # and every call after: nothing half-built


@pytest.mark.parametrize(
    ("option", "value"),
    [("timeout", "5"), ("timeout", 0), ("timeout", -1), ("max_workers", "8")],
)
def test_a_call_option_that_makes_no_sense_is_a_config_error_naming_it(
    redis_url: str, prefix: str, option: str, value: Any
) -> None:
    """``"timeout": "5"`` (from an env var) failed every call with a TypeError from
    inside ``threading``; 0 or -1 every call with "starting the cache did not finish
    within 0 s"; ``max_workers`` was a ValueError, not the ConfigError the docs promise."""
    cache = _backend(redis_url, prefix, {}, **{option: value})
    with pytest.raises(ConfigError, match=re.escape(f"<CACHES OPTIONS>: {option} must be")):
        cache.set("k", 1)


@pytest.mark.parametrize("timeout", [2.5, 20, None])
def test_sensible_call_timeouts_work(redis_url: str, prefix: str, timeout: Any) -> None:
    cache = _backend(redis_url, prefix, {}, timeout=timeout)
    cache.set("k", 1)
    assert cache.get("k") == 1
