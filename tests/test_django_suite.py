"""Django's own cache tests judge the backend: ``BaseCacheTests`` from the Django sdist's
``tests/cache/tests.py`` (fetched by ``make test-django``), run against
``layered_cache.django.LayeredCacheBackend`` on a real Redis.

Each case that does not apply is skipped here with its reason (docs/django.md lists
them); everything else must pass as it does for Django's own backends.
"""

from __future__ import annotations

import unittest
import uuid
from collections.abc import Iterator

import pytest

from layered_cache._django_setup import close_shared
from tests import djangoconf

if not djangoconf.suite_available():
    pytest.skip(
        f"Django's tests/cache is not in {djangoconf.SUITE_DIR}: run `make test-django`",
        allow_module_level=True,
    )
djangoconf.configure()

from cache import tests as django_cache_tests  # type: ignore[import-not-found]  # noqa: E402
from django.test import SimpleTestCase, override_settings  # noqa: E402

NEEDS_PICKLE = (
    "stores {what}: needs pickle, and layered_cache never unpickles (docs/django.md#values)"
)
NOT_APPLICABLE = {
    "test_data_types": NEEDS_PICKLE.format(what="a function and a class"),
    "test_cache_read_for_model_instance": NEEDS_PICKLE.format(what="a model instance"),
    "test_cache_write_for_model_instance_with_deferred": NEEDS_PICKLE.format(what="a QuerySet"),
    "test_cache_read_for_model_instance_with_deferred": NEEDS_PICKLE.format(what="a QuerySet"),
}


def _redis(redis_url: str, prefix: str) -> dict[str, object]:
    """Patient timeouts: Django's cases judge cache semantics, not latency, and CI's
    starved 2 cores once timed a read out at the 100 ms default (Redis errors reach
    Django's callers, as they do from its own RedisCache)."""
    return {"url": redis_url, "prefix": prefix, "timeout": "3s", "connect_timeout": "3s"}


def _caches(redis_url: str, prefix: str) -> dict[str, dict[str, object]]:
    base = {
        "BACKEND": "layered_cache.django.LayeredCacheBackend",
        "OPTIONS": {"config": {"redis": _redis(redis_url, prefix)}},
    }
    # Like Django's RedisCacheTests: no cull caches (eviction is Redis's maxmemory policy).
    settings: dict[str, dict[str, object]] = django_cache_tests.caches_setting_for_tests(
        base=base, exclude={"cull", "zero_cull"}
    )
    return settings


def _retarget(
    caches: dict[str, dict[str, object]], options: dict[str, object]
) -> dict[str, object]:
    """A class's LocMemCache aliases as ours: each LOCATION (a separate store for
    locmem) becomes a namespace of its own, other parameters (TIMEOUT, KEY_PREFIX) kept."""
    ours: dict[str, object] = {}
    for alias, params in caches.items():
        location = str(params.get("LOCATION") or "default")
        kept = {k: v for k, v in params.items() if k not in ("BACKEND", "LOCATION", "OPTIONS")}
        ours[alias] = {
            **kept,
            "BACKEND": "layered_cache.django.LayeredCacheBackend",
            "OPTIONS": {**options, "namespace": f"dj_{location}"},
        }
    return ours


@pytest.fixture(scope="module", autouse=True)
def layered_caches(redis_url: str) -> Iterator[None]:
    prefix = f"dj{uuid.uuid4().hex[:8]}:"
    options = {"config": {"redis": _redis(redis_url, prefix)}}
    for cls in RETARGETED:
        caches = cls._overridden_settings["CACHES"]
        cls._overridden_settings = {
            **cls._overridden_settings,
            "CACHES": _retarget(caches, options),
        }
    with override_settings(CACHES=_caches(redis_url, prefix)):
        yield
    close_shared()


class LayeredCacheBackendTests(django_cache_tests.BaseCacheTests, SimpleTestCase):  # type: ignore[misc]
    """Django's BaseCacheTests against layered_cache.django (cases above: skipped)."""


for _name, _reason in NOT_APPLICABLE.items():
    setattr(LayeredCacheBackendTests, _name, unittest.skip(_reason)(lambda self: None))


# Django's tests of what it builds on a cache (cache_page and the cache middleware,
# i18n cache keys, TemplateResponse, HEAD requests, django.utils.cache), written against
# LocMemCache: run against ours, each with its own CACHES aliases retargeted.
RETARGETED = [
    type(name, (getattr(django_cache_tests, name),), {"__module__": __name__})
    for name in (
        "CacheUtils",
        "PrefixedCacheUtils",
        "CacheHEADTest",
        "CacheI18nTest",
        "PrefixedCacheI18nTest",
        "CacheMiddlewareTest",
        "TestWithTemplateResponse",
    )
]
globals().update({cls.__name__: cls for cls in RETARGETED})
