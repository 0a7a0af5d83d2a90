"""A namespace's compiled policy: the config turned into what the read path needs.

Compiled once at startup (templates parsed, durations as floats, layers resolved to
``None`` when switched off) so a request does one dict lookup to get everything.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from layered_cache._codec import Codec
from layered_cache._config import Config, HotConfig, L1Config, L2Config, NamespaceConfig
from layered_cache._config.validate import check_namespaces
from layered_cache._hotkeys import HotKeyDetector
from layered_cache._keys import KeyTemplate
from layered_cache._l1 import L1Cache
from layered_cache._stats import NamespaceStats
from layered_cache._tombstones import KeyTombstones

__all__ = ["Policy", "compile_policies", "compile_policy", "jittered"]


def jittered(ttl: float, jitter: float, rand: float) -> float:
    """``ttl * (1 +- jitter)`` for ``rand`` uniform in [0, 1): spreads expiries so keys
    warmed together don't expire in the same second."""
    return ttl * (1.0 + jitter * (2.0 * rand - 1.0))


@dataclass(slots=True, eq=False)
class Policy:
    name: str
    template: KeyTemplate
    cache: bool
    l1: L1Cache | None
    l1_ttl: float
    l1_jitter: float
    l2: bool
    l2_ttl: float
    l2_jitter: float
    stale_max_age: float
    replicas: int
    hot: HotKeyDetector | None
    lease_ttl: float
    reread_pause: tuple[float, float]  # jittered pause between a waiter's re-reads
    max_wait: float
    beta: float
    load_timeout: float | None
    max_value_bytes: int
    tags: bool  # entries may carry tags (``_tags``)
    codec: Codec[Any]
    stats: NamespaceStats = field(default_factory=NamespaceStats)
    # A value's own expiry (Redis time; None: the namespace's): a Django entry's timeout.
    expiry_of: Callable[[Any], float | None] | None = None
    # Where a read learns that the key was invalidated or written here since it began
    # (``_served``): the L1's tombstones, or without L1 tombstones of their own.
    marks: L1Cache | KeyTombstones = field(init=False)

    def __post_init__(self) -> None:
        self.marks = self.l1 if self.l1 is not None else KeyTombstones()

    def l1_ttl_draw(self) -> float:
        return jittered(self.l1_ttl, self.l1_jitter, random.random())

    def l2_ttl_draw(self) -> float:
        return jittered(self.l2_ttl, self.l2_jitter, random.random())

    def soft_expiry(self, value: Any, now: float) -> float:
        """When ``value``, written now, goes stale: after the namespace's jittered L2
        TTL; a value with its own expiry (a Django timeout) then, capped at the L2 TTL
        itself. The caller chose that expiry: capped at a jittered draw, a timeout just
        under the TTL was cut by up to ``jitter`` of it. Redis drops the value in the
        very write that stores it: a PEXPIRE after the write could land on another
        writer's value (a Django entry without timeout vanished at a racing one's)."""
        own = self.expiry_of(value) if self.expiry_of is not None else None
        if own is None:
            return now + self.l2_ttl_draw()
        return min(own, now + self.l2_ttl)


def compile_policies(config: Config) -> dict[str, Policy]:
    """Every namespace's policy, after the checks that concern them together: a cache
    (or the daemon) may be given a Config that never went through load, and two
    namespaces that build one name would read and delete each other's values."""
    check_namespaces(config)
    prefix = config.redis.prefix
    return {name: compile_policy(name, ns, prefix) for name, ns in config.namespaces.items()}


def compile_policy(
    name: str, config: NamespaceConfig, prefix: str, value_type: Any = Any
) -> Policy:
    l1 = L1Config() if config.l1 is True else config.l1 or None
    l2 = L2Config() if config.l2 is True else config.l2 or None
    hot = HotConfig() if config.hot is True else config.hot or None
    detector = None
    if hot is not None and l2 is not None:
        detector = HotKeyDetector(
            threshold=hot.threshold,
            window=hot.window,
            cooldown=hot.cooldown,
            static=[prefix + key for key in hot.keys],
        )
    stampede = config.stampede
    return Policy(
        name=name,
        template=KeyTemplate(name, config.key, prefix),
        cache=config.cache,
        l1=L1Cache(l1.max_entries) if (l1 is not None and config.cache) else None,
        l1_ttl=l1.ttl if l1 else 0.0,
        l1_jitter=l1.jitter if l1 else 0.0,
        l2=l2 is not None and config.cache,
        l2_ttl=l2.ttl if l2 else 0.0,
        l2_jitter=l2.jitter if l2 else 0.0,
        stale_max_age=config.stale.max_age,
        replicas=hot.replicas if hot else 0,
        hot=detector,
        lease_ttl=stampede.lease_ttl,
        reread_pause=(stampede.reread_pause[0], stampede.reread_pause[1]),
        max_wait=stampede.max_wait,
        beta=stampede.early_refresh_beta,
        load_timeout=stampede.load_timeout,
        max_value_bytes=config.max_value_bytes,
        tags=config.tags,
        codec=Codec(value_type),
    )
