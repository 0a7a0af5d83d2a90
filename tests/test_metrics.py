"""Prometheus export (read at scrape time) and the optional OpenTelemetry load spans."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

import pytest
import redis.asyncio as redis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from layered_cache import LayeredCache
from layered_cache._batch_read import BatchReader
from layered_cache._keys import lease_name
from layered_cache._l2 import L2Unavailable
from layered_cache._tracing import SPAN_NAME, instrument
from layered_cache.prometheus import register_cache, render_metrics, unregister_cache
from layered_cache.sync import SyncLayeredCache
from tests.helpers import CountingLoader, make_config
from tests.servers import free_port


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = render_metrics(registry)
    assert content_type.startswith("text/plain")
    result = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return result


def value(data: dict[Any, float], name: str, **labels: str) -> float:
    return data[(name, tuple(sorted(labels.items())))]


async def test_counters_gauges_and_histograms(redis_url: str, prefix: str) -> None:
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}", "hot": {"replicas": 2, "keys": ["book:9"]}}},
    )
    registry = CollectorRegistry()
    async with LayeredCache.from_config(config) as cache:
        assert register_cache(cache, registry) is register_cache(cache, registry)
        loader = CountingLoader("v", delay=0.02)
        await asyncio.gather(*(cache.get_or_load("book", {"id": 1}, loader) for _ in range(5)))
        for _ in range(10):
            await cache.get_or_load("book", {"id": 1}, loader)  # L1 hits: no histogram
        async with LayeredCache.from_config(config) as other:
            await other.get_or_load("book", {"id": 1}, loader)  # an L2 hit elsewhere
        data = samples(registry)
        instance = cache.instance_id

    assert value(data, "layered_cache_requests_total", namespace="book", result="l1_hit") == 10
    assert value(data, "layered_cache_requests_total", namespace="book", result="miss") == 1
    assert value(data, "layered_cache_requests_total", namespace="book", result="l2_hit") == 0
    assert value(data, "layered_cache_loads_total", namespace="book") == 1
    assert value(data, "layered_cache_coalesced_total", namespace="book") == 4
    assert value(data, "layered_cache_lease_total", namespace="book", outcome="won") == 1
    assert value(data, "layered_cache_redis_errors_total", namespace="book") == 0
    assert value(data, "layered_cache_hot_keys", namespace="book") == 1  # static book:9
    assert value(data, "layered_cache_l1_entries", namespace="book") == 1
    assert value(data, "layered_cache_breaker_state", instance=instance, node="default", state="closed") == 1
    assert value(data, "layered_cache_breaker_state", instance=instance, node="default", state="open") == 0
    load = value(data, "layered_cache_load_seconds_count", namespace="book", outcome="ok")
    assert load == 1
    assert value(data, "layered_cache_load_seconds_sum", namespace="book", outcome="ok") >= 0.02
    # one L2 read for the single-flight miss: the 10 L1 hits were not observed
    assert value(data, "layered_cache_l2_read_seconds_count", namespace="book") == 1
    inf = value(data, "layered_cache_l2_read_seconds_bucket", namespace="book", le="+Inf")
    assert inf == 1


async def test_several_caches_are_summed_and_can_be_removed(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix)
    registry = CollectorRegistry()
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        register_cache(a, registry)
        register_cache(b, registry)
        await a.set("book", {"id": 1}, 1)
        await b.set("book", {"id": 2}, 2)
        assert value(samples(registry), "layered_cache_sets_total", namespace="book") == 2
        unregister_cache(b, registry)
        assert b.hooks.load_observers == [] and b.hooks.l2_observers == []
        await b.set("book", {"id": 3}, 3)  # no longer exported: not counted
        await a.set("book", {"id": 4}, 4)
        # b's two sets stay in the sum: a counter never decreases
        assert value(samples(registry), "layered_cache_sets_total", namespace="book") == 3


L1_HITS = ("layered_cache_requests_total", {"namespace": "book", "result": "l1_hit"})


def _l1_hits(registry: CollectorRegistry) -> float:
    return registry.get_sample_value(*L1_HITS) or 0.0


async def _reads(cache: LayeredCache, n: int) -> None:
    for _ in range(n + 1):  # the first one loads
        await cache.get_or_load("book", {"id": 1}, CountingLoader("v"))


async def test_unregistering_one_of_two_caches_never_decreases_a_counter(
    redis_url: str, prefix: str
) -> None:
    """Prometheus reads a decrease as a reset: rate() showed the other cache's whole
    total again as a burst of reads that never happened."""
    registry, config = CollectorRegistry(), make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:
        register_cache(a, registry)
        register_cache(b, registry)
        await _reads(a, 30)
        await _reads(b, 20)
        await _reads(a, 5)  # 6 more hits, after the last scrape: counted too
        unregister_cache(a, registry)
        assert _l1_hits(registry) == 56
        await _reads(b, 1)
        assert _l1_hits(registry) == 58


async def test_a_closed_and_collected_cache_never_decreases_a_counter(
    redis_url: str, prefix: str
) -> None:
    registry, config = CollectorRegistry(), make_config(redis_url, prefix)
    async with LayeredCache.from_config(config) as b:
        register_cache(b, registry)
        old = LayeredCache.from_config(config)  # e.g. replaced on a config reload
        await old.start()
        register_cache(old, registry)
        await _reads(old, 30)
        await _reads(b, 20)
        assert _l1_hits(registry) == 50
        await _reads(old, 5)  # 6 more hits, after the last scrape, before it goes
        await old.close()
        gone = weakref.ref(old)
        del old
        gc.collect()
        assert gone() is None  # left the collector's WeakSet without unregister_cache
        assert _l1_hits(registry) == 56


def test_a_sync_cache_closed_and_started_again_never_decreases_a_counter(
    redis_url: str, prefix: str
) -> None:
    registry = CollectorRegistry()
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        register_cache(cache, registry)
        for _ in range(4):
            cache.get_or_load("book", {"id": 1}, lambda: "v")
        assert _l1_hits(registry) == 3
        cache.close()  # its inner cache goes; a new one is built by start()
        assert _l1_hits(registry) == 3
        cache.start()
        cache.get_or_load("book", {"id": 1}, lambda: "v")  # a fresh L1: loads again
        cache.get_or_load("book", {"id": 1}, lambda: "v")
        assert _l1_hits(registry) == 4


async def test_failed_loads_and_redis_errors(redis_url: str, prefix: str) -> None:
    config = make_config(f"redis://127.0.0.1:{free_port()}/0", prefix, backplane={"enabled": False})
    registry = CollectorRegistry()
    async with LayeredCache.from_config(config) as cache:
        register_cache(cache, registry)
        loader = CountingLoader("v")
        loader.error = RuntimeError("db down")
        for i in range(3):
            with suppress(RuntimeError):
                await cache.get_or_load("book", {"id": i}, loader)
        data = samples(registry)
        instance = cache.instance_id
    assert value(data, "layered_cache_load_errors_total", namespace="book") == 3
    assert value(data, "layered_cache_redis_errors_total", namespace="book") == 3
    assert value(data, "layered_cache_load_seconds_count", namespace="book", outcome="error") == 3
    assert value(data, "layered_cache_breaker_state", instance=instance, node="default", state="closed") == 0


async def test_metrics_disabled_registers_nothing(redis_url: str, prefix: str) -> None:
    config = make_config(redis_url, prefix, metrics={"enabled": False})
    registry = CollectorRegistry()
    async with LayeredCache.from_config(config) as cache:
        assert register_cache(cache, registry) is None
    assert b"layered_cache" not in render_metrics(registry)[0]


class FakeTracer:
    def __init__(self) -> None:
        self.spans: list[tuple[str, dict[str, Any]]] = []
        self.active = 0

    @contextmanager
    def start_as_current_span(self, name: str, attributes: dict[str, Any]) -> Iterator[None]:
        self.spans.append((name, attributes))
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


async def test_load_spans_wrap_the_loader(redis_url: str, prefix: str) -> None:
    tracer = FakeTracer()
    seen: list[int] = []

    async def loader() -> str:
        seen.append(tracer.active)
        return "v"

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert instrument(cache, tracer) is True
        await cache.get_or_load("book", {"id": 1}, loader)
        await cache.get_or_load("book", {"id": 1}, loader)  # L1 hit: no span
    assert tracer.spans == [(SPAN_NAME, {"cache.namespace": "book"})]
    assert seen == [1]  # the loader ran inside the span


async def test_instrument_without_opentelemetry_is_a_no_op(redis_url: str, prefix: str) -> None:
    import importlib.util

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        installed = importlib.util.find_spec("opentelemetry") is not None
        assert instrument(cache) is installed
        assert (cache.hooks.load_wrapper is not None) is installed


async def test_a_cache_unregistered_and_registered_again_is_counted_once(
    redis_url: str, prefix: str
) -> None:
    """Its counters were retired when it left and counted live again when it came back:
    every counter of its namespaces doubled, a burst in rate() that never happened."""
    registry, config = CollectorRegistry(), make_config(redis_url, prefix)
    l1_hits = ("layered_cache_requests_total", {"namespace": "book", "result": "l1_hit"})
    async with LayeredCache.from_config(config) as cache:
        register_cache(cache, registry)
        for _ in range(11):  # the first one loads
            await cache.get_or_load("book", {"id": 1}, CountingLoader("v"))
        assert registry.get_sample_value(*l1_hits) == 10
        unregister_cache(cache, registry)
        assert registry.get_sample_value(*l1_hits) == 10  # retired: never decreases
        register_cache(cache, registry)
        assert registry.get_sample_value(*l1_hits) == 10
        await cache.get_or_load("book", {"id": 1}, CountingLoader("v"))
        assert registry.get_sample_value(*l1_hits) == 11
        unregister_cache(cache, registry)
        assert registry.get_sample_value(*l1_hits) == 11


# -- requests_total{result="miss"}: every read the loader answered, once ------------------
# docs/metrics.md: ``layered_cache_requests_total`` is "reads by the layer that answered;
# ``miss`` went to the loader", and the hit ratio is
# ``rate(requests_total{result=~"l1_hit|l2_hit"}) / rate(requests_total)``. The reads
# the loader answered because Redis failed were not counted at all (``Namespace._fetch``
# and ``BatchLoader.fetch_many`` counted ``redis_error`` and loaded): during an outage,
# in which every read but the L1 hits goes to the database, the hit ratio read 100 %.


def _requests(cache: LayeredCache) -> tuple[int, int, int, int]:
    stats = cache.stats()["book"]
    return stats["l1_hit"], stats["l2_hit"], stats["miss"], stats["load"]  # type: ignore[return-value]


async def _load_many(fields_list: list[Mapping[str, object]]) -> list[str]:
    return [f"v{fields['id']}" for fields in fields_list]


async def test_reads_answered_by_the_loader_while_redis_is_down_count_as_misses(
    prefix: str,
) -> None:
    """Redis unreachable: 5 ``get_or_load`` of 5 distinct keys (the first two fail on
    Redis, the next ones find the breaker open), then one more of book 0, an L1 hit
    (the loaded value is kept in L1). miss was 0 with loads_total 5."""
    config = make_config(f"redis://127.0.0.1:{free_port()}/0", prefix, backplane={"enabled": False})
    registry = CollectorRegistry()
    async with LayeredCache.from_config(config) as cache:
        register_cache(cache, registry)
        loader = CountingLoader("v")
        for book in range(5):
            assert await cache.get_or_load("book", {"id": book}, loader) == "v"
        assert await cache.get_or_load("book", {"id": 0}, loader) == "v"  # L1
        data = samples(registry)
    assert loader.calls == 5
    assert value(data, "layered_cache_loads_total", namespace="book") == 5
    assert value(data, "layered_cache_redis_errors_total", namespace="book") == 5
    requests = {
        result: value(data, "layered_cache_requests_total", namespace="book", result=result)
        for result in ("l1_hit", "l2_hit", "miss")
    }
    assert requests == {"l1_hit": 1, "l2_hit": 0, "miss": 5}


async def test_a_batch_read_while_redis_is_down_counts_each_loaded_key_once(
    prefix: str,
) -> None:
    """``get_or_load_many`` of 3 keys with Redis unreachable: one ``load_many`` call, 3
    misses (were 0); again: 3 L1 hits."""
    config = make_config(f"redis://127.0.0.1:{free_port()}/0", prefix, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:
        books = [{"id": book} for book in range(3)]
        assert await cache.get_or_load_many("book", books, _load_many) == ["v0", "v1", "v2"]
        assert _requests(cache) == (0, 0, 3, 3)
        assert await cache.get_or_load_many("book", books, _load_many) == ["v0", "v1", "v2"]
        assert _requests(cache) == (3, 0, 3, 3)


async def test_a_batch_key_left_unread_by_a_failed_master_counts_one_miss(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of book 1 (in Redis), 2 (absent) and 3, whose master failed (a cluster
    master down: left out of the MGET's answer, forced here). 1 is an L2 hit, 2 and 3
    load: 2 misses (3 was not counted)."""
    read_many = BatchReader.read_many

    async def master_down(self: BatchReader, keys: list[str], **kw: Any) -> dict[str, Any]:
        return {k: v for k, v in (await read_many(self, keys, **kw)).items() if k != lost}

    namespaces = {"book": {"key": "book:{id}", "l1": False}}  # book 1 is read from Redis
    config = make_config(redis_url, prefix, namespaces, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "v1")
        lost = cache.key("book", {"id": 3})
        monkeypatch.setattr(BatchReader, "read_many", master_down)
        books = [{"id": book} for book in (1, 2, 3)]
        assert await cache.get_or_load_many("book", books, _load_many) == ["v1", "v2", "v3"]
        assert _requests(cache) == (0, 1, 2, 2)
        assert cache.stats()["book"]["redis_error"] == 1


async def test_a_read_whose_lease_wait_fails_counts_one_miss(redis_url: str, prefix: str) -> None:
    """Book 1 and 2 absent, their leases held by another process; waiting for its fill,
    Redis fails: each read loads without writing L2. One miss each (single and batch
    path), not two: the miss was counted when L2 had nothing."""
    config = make_config(redis_url, prefix, backplane={"enabled": False})
    admin = redis.Redis.from_url(redis_url)
    async with LayeredCache.from_config(config) as cache:
        for book in (1, 2):
            await admin.set(lease_name(cache.key("book", {"id": book})), "another", px=5000)

        async def redis_fails(*args: Any, **kwargs: Any) -> Any:
            raise L2Unavailable("down")

        cache._rt.leases.wait_for_fill = redis_fails  # type: ignore[method-assign]
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
        assert await cache.get_or_load_many("book", [{"id": 2}], _load_many) == ["v2"]
        stats = cache.stats()["book"]
    await admin.aclose()
    assert _requests(cache) == (0, 0, 2, 2)
    assert stats["redis_error"] == 2


async def test_a_read_whose_lease_request_fails_counts_one_miss(
    redis_url: str, prefix: str
) -> None:
    """Book 1 absent; Redis fails on the lease's SET NX: the read loads without writing
    L2. One miss (counted when L2 had nothing), one load."""
    config = make_config(redis_url, prefix, backplane={"enabled": False})
    async with LayeredCache.from_config(config) as cache:

        async def redis_fails(*args: Any, **kwargs: Any) -> Any:
            raise L2Unavailable("down")

        cache._rt.leases.try_acquire = redis_fails  # type: ignore[method-assign]
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v1")) == "v1"
        assert _requests(cache) == (0, 0, 1, 1)
        assert cache.stats()["book"]["redis_error"] == 1
