"""Security: no code execution from Redis, tenants and namespaces stay apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis.asyncio as redis

from layered_cache import ConfigError, LayeredCache, parse_config
from tests.helpers import CountingLoader, make_config

PACKAGES = [
    Path(__file__).resolve().parent.parent / name for name in ("layered_cache", "consumers")
]


def test_no_pickle_eval_or_exec_anywhere_in_the_packages() -> None:
    pattern = re.compile(
        r"\bimport pickle\b|\bpickle\.|(?<![.\w])eval\(|(?<![.\w])exec\(|marshal\.loads|yaml\.load\("
    )
    offenders = [
        f"{path}:{number}"
        for package in PACKAGES
        for path in package.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == []


async def test_a_pickle_payload_in_redis_is_a_miss_not_code(redis_url: str, prefix: str) -> None:
    import pickle  # only to build the hostile payload

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    admin = redis.Redis.from_url(redis_url)
    await admin.set(f"{prefix}book:1", pickle.dumps(Boom()))
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("safe")) == "safe"
        assert cache.stats()["book"]["decode_error"] == 1
    await admin.aclose()


async def test_prefixes_keep_tenants_apart(redis_url: str, prefix: str) -> None:
    tenant_a = make_config(redis_url, f"{prefix}a:")
    tenant_b = make_config(redis_url, f"{prefix}b:")
    async with LayeredCache.from_config(tenant_a) as a, LayeredCache.from_config(tenant_b) as b:
        await a.set("book", {"id": 1}, "A's book")
        await b.set("book", {"id": 1}, "B's book")
        await a.invalidate("book", {"id": 1})
        assert await b.get("book", {"id": 1}) == "B's book"
        assert await a.get("book", {"id": 1}) is None
        assert a.key("book", {"id": 1}) != b.key("book", {"id": 1})


async def test_namespaces_never_share_keys(redis_url: str, prefix: str) -> None:
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}"}, "author": {"key": "author:{id}"}},
    )
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "book 1")
        await cache.set("author", {"id": 1}, "author 1")
        await cache.invalidate("author", {"id": 1})
        assert await cache.get("book", {"id": 1}) == "book 1"
        # A field value can't smuggle another namespace's key: braces, '#' are refused.
        with pytest.raises(ValueError):
            cache.key("author", {"id": "1}:lease"})


@pytest.mark.parametrize(
    ("first", "second"),
    [("book:{id}", "book:{id}:{lang}"), ("b{id}", "book:{id}"), ("{id}", "book:{id}")],
)
def test_overlapping_namespace_templates_are_rejected(first: str, second: str) -> None:
    with pytest.raises(ConfigError, match="namespaces"):
        parse_config({"namespaces": {"one": {"key": first}, "two": {"key": second}}}, env={})
