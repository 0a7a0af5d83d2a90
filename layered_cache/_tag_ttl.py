"""How long a tag's token key lives in Redis (``_tags`` module doc, "Token keys
expire"): a day at least, twice the longest tagged entry's life if that is longer."""

from __future__ import annotations

from layered_cache._config.schema import Config, L1Config, L2Config, NamespaceConfig

__all__ = ["VERSION_TTL_FLOOR", "version_ttl"]

VERSION_TTL_FLOOR = 86_400.0  # seconds: a token key lives at least a day after its last use


def version_ttl(config: Config) -> float:
    """How long a tag's token key lives after its last fetch or invalidation (seconds):
    a day, or twice the longest life of an entry of a tagged namespace if longer (the
    ``_tags`` module doc says why twice). ``expiry_of`` can only shorten an entry's life
    (``Policy.soft_expiry``), so the namespace's TTL bounds it."""
    lives = [_entry_life(ns) for ns in config.namespaces.values() if ns.tags]
    return max(VERSION_TTL_FLOOR, 2 * max(lives, default=0.0))


def _entry_life(ns: NamespaceConfig) -> float:
    """The longest an entry of ``ns`` lives: in Redis, or in L1 when it has no L2."""
    if ns.l2 is not False:
        l2 = ns.l2 if isinstance(ns.l2, L2Config) else L2Config()
        return l2.ttl * (1 + l2.jitter) + ns.stale.max_age
    if ns.l1 is not False:
        l1 = ns.l1 if isinstance(ns.l1, L1Config) else L1Config()
        return l1.ttl * (1 + l1.jitter)
    return 0.0
