"""What the relay says while it can't follow its stream upstream (``_relay``).

Why: the relay's follower retries every Redis failure with backoff, and said nothing
about it. A relay rolled out with a wrong password (an AuthenticationError on every
attempt), or started while Redis was down, logged only ``relay_status following=False``
at info level for ever, while its tcpSocket probes passed and every instance behind it
was deaf (each connection closed at once: the backplane disconnected, L1 never
dropped). The daemon, in the same spot, logs ``redis_unreachable`` (``daemon.watch``).

``relay_upstream_unreachable`` (a warning) names the error, redacted (no password of any
URL shape): at the first failure, then at most once per ``every`` seconds while they go
on, with how many there were and for how long. ``relay_upstream_reachable_again`` (info)
when the relay follows again.
"""

from __future__ import annotations

import time

import structlog

from layered_cache._logs import error_text
from layered_cache._redact import redact

__all__ = ["Outage"]

_log = structlog.get_logger("layered_cache.relay")

EVERY = 30.0  # seconds between warnings while the upstream stays unreachable


class Outage:
    """Counts the follower's upstream failures in a row and logs them, rate-limited."""

    def __init__(self, every: float = EVERY) -> None:
        self._every = every
        self._since: float | None = None  # monotonic time of the first failure in a row
        self._logged_at = 0.0
        self._failures = 0

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._failures += 1
        if self._since is None:
            self._since = now
        elif now - self._logged_at < self._every:
            return
        self._logged_at = now
        _log.warning(
            "relay_upstream_unreachable",
            error=error_text(exc, redact(f"{type(exc).__name__}: {exc}")[:300]),
            failures=self._failures,
            down_seconds=round(now - self._since, 1),
        )

    def ended(self) -> None:
        """The relay follows the stream again."""
        if self._since is None:
            return
        _log.info(
            "relay_upstream_reachable_again",
            failures=self._failures,
            down_seconds=round(time.monotonic() - self._since, 1),
        )
        self._since, self._failures = None, 0
