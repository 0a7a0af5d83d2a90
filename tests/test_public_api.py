"""The public surface is what ``layered_cache`` exports: pinned here, so a change to it
is a deliberate edit of this file (and of the changelog), never a side effect."""

from __future__ import annotations

import importlib
import pkgutil
import tomllib
from pathlib import Path

import layered_cache

PUBLIC_NAMES = [
    "BackplaneStatus",
    "BookPriceChanged",
    "CacheInvalidate",
    "CodecError",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "L2Unavailable",
    "LayeredCache",
    "Namespace",
    "RedisStatus",
    "ReplicaCountMismatch",
    "SyncLayeredCache",
    "configure_logging",
    "encode_event",
    "instrument",
    "load_config",
    "parse_config",
    "redact_event",
]
# Modules users import by name: the sync facade, HTTP caching (``asgi`` needs Starlette),
# and the ones with optional extras.
PUBLIC_MODULES = {"asgi", "cli", "daemon", "django", "http", "prometheus", "purge", "sync"}
LAYERED_CACHE_METHODS = {
    "backplane_status",
    "cached",
    "close",
    "config",
    "from_config",
    "get",
    "get_many",
    "get_or_load",
    "get_or_load_many",
    "hooks",
    "hot_keys",
    "instance_id",
    "invalidate",
    "invalidate_tag",
    "key",
    "namespace",
    "purge_stats",
    "redis_status",
    "set",
    "set_many",
    "start",
    "stats",
}


def test_the_package_exports_exactly_the_public_names() -> None:
    assert sorted(layered_cache.__all__) == PUBLIC_NAMES
    for name in PUBLIC_NAMES:
        assert getattr(layered_cache, name) is not None


def test_every_module_but_the_public_ones_is_private() -> None:
    modules = {info.name for info in pkgutil.iter_modules(layered_cache.__path__)}
    public = {name for name in modules if not name.startswith("_")}
    assert public == PUBLIC_MODULES
    for name in PUBLIC_MODULES - {"daemon", "prometheus"}:
        importlib.import_module(f"layered_cache.{name}")


def test_layered_cache_has_no_public_attribute_beyond_its_api() -> None:
    public = {name for name in dir(layered_cache.LayeredCache) if not name.startswith("_")}
    assert public == LAYERED_CACHE_METHODS - {"config"}  # config: set per instance


NAMESPACE_METHODS = {
    "get",
    "get_many",
    "get_or_load",
    "get_or_load_many",
    "hot_keys",
    "key",
    "name",
    "policy",
    "set",
    "set_many",
    "stats",
}


def test_a_namespace_has_no_public_attribute_beyond_its_api() -> None:
    public = {name for name in dir(layered_cache.Namespace) if not name.startswith("_")}
    assert public == NAMESPACE_METHODS - {"name", "policy"}  # set per instance


def test_the_wheel_ships_py_typed_so_users_mypy_sees_the_annotations() -> None:
    package = Path(layered_cache.__file__).parent
    assert (package / "py.typed").is_file()
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["layered_cache"]
