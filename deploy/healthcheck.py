"""The image's HEALTHCHECK: healthy when the process the container runs answers /healthz.

The image runs either the invalidation daemon (its default command: ``/healthz`` on
``kafka.health_port``, 9464 in the baked-in config) or the bookstore example
(``python -m examples.bookstore``: ``/healthz`` on ``--port``, 8000 by default). A
container runs one of them, so the check passes when any of the URLs answers 200.

    python /app/healthcheck.py [URL ...]     # default: both URLs below; exit 0 = healthy

Each probe waits at most 1.2 s, so two fit the HEALTHCHECK's 3 s timeout.
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Sequence

DEFAULT_URLS = ("http://127.0.0.1:9464/healthz", "http://127.0.0.1:8000/healthz")
PROBE_TIMEOUT = 1.2


def healthy(urls: Sequence[str]) -> bool:
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT) as response:
                if response.status == 200:
                    return True
        except (OSError, ValueError):  # refused, timed out, HTTP error status, bad URL
            continue
    return False


if __name__ == "__main__":
    sys.exit(0 if healthy(sys.argv[1:] or DEFAULT_URLS) else 1)
