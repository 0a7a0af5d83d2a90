"""Config builders for the scenarios (through ``layered_cache.parse_config``, env={})."""

from __future__ import annotations

from typing import Any

from layered_cache import Config, parse_config

__all__ = ["make_config"]


def make_config(
    redis_url: str,
    prefix: str,
    namespaces: dict[str, dict[str, Any]],
    *,
    cluster: bool = False,
    backplane: bool | dict[str, Any] = True,
    timeout: str = "1s",
    connect_timeout: str = "1s",
    busy_poll: str | None = None,  # None: the default; "0s" for the rows without it
    **sections: Any,
) -> Config:
    raw: dict[str, Any] = {
        "redis": {
            "url": redis_url,
            "prefix": prefix,
            "cluster": cluster,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
            "max_connections": 256,
            **({} if busy_poll is None else {"busy_poll": busy_poll}),
        },
        "backplane": backplane if isinstance(backplane, dict) else {"enabled": backplane},
        "logging": {"level": "warning"},
        "namespaces": namespaces,
        **sections,
    }
    return parse_config(raw, source="<bench>", env={})
