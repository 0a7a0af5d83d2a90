"""Optional dependencies: a missing one is an ImportError that says what to install.

The library's core needs only Redis and friends; the daemon (``[daemon]``: aiokafka,
cramjam, prometheus-client) and the Prometheus export (``[prometheus]``) are extras, so a
service that only caches doesn't install Kafka clients. Without this, a user sees
"No module named 'aiokafka'" and has to guess which extra brings it.
"""

from __future__ import annotations

__all__ = ["EXTRAS", "MissingExtraError", "missing_extra"]

#: Extra -> the top-level modules it installs.
EXTRAS: dict[str, tuple[str, ...]] = {
    "daemon": ("aiokafka", "cramjam", "prometheus_client"),
    "prometheus": ("prometheus_client",),
    "django": ("django",),
}


class MissingExtraError(ImportError):
    """An optional dependency of ``feature`` is not installed."""


def missing_extra(feature: str, extra: str, error: ImportError) -> ImportError:
    """The error to raise (``from error``) when importing ``feature`` failed with ``error``.

    Returns ``error`` itself when it is not about one of the extra's modules (a broken
    install of something else must not be blamed on the extra)."""
    missing = (error.name or "").partition(".")[0]
    if missing not in EXTRAS[extra]:
        return error
    return MissingExtraError(
        f"{feature} needs the optional dependencies of the {extra!r} extra "
        f"({missing} is not installed): pip install 'layered-cache[{extra}]'",
        name=error.name,
    )
