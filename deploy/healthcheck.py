"""The image's HEALTHCHECK: healthy when the process the container runs answers /healthz.

The image runs either the invalidation daemon (its default command: ``/healthz`` on
``kafka.health_port``, 9464 in the baked-in config) or the bookstore example
(``python -m examples.bookstore``: ``/healthz`` on ``--port``, 8000 by default). A
container runs one of them, so the check passes when any of the URLs answers 200.

    python /app/healthcheck.py [URL ...]     # default: both URLs below; exit 0 = healthy

A ``redis://HOST:PORT`` URL probes a backplane relay (``layered-cache relay``): healthy
when it answers PING. A relay that follows no stream (its Redis refuses its password, or
is down) closes every connection at once, so a TCP probe passes while every instance
behind it is deaf; this one fails (deploy/k8s/relay.yaml's readiness probe).

Each probe waits at most 1.2 s, so two fit the HEALTHCHECK's 3 s timeout.
"""

from __future__ import annotations

import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Sequence

DEFAULT_URLS = ("http://127.0.0.1:9464/healthz", "http://127.0.0.1:8000/healthz")
PROBE_TIMEOUT = 1.2


def _answers_ping(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 6379)
    with socket.create_connection(address, timeout=PROBE_TIMEOUT) as conn:
        conn.settimeout(PROBE_TIMEOUT)
        conn.sendall(b"*1\r\n$4\r\nPING\r\n")
        return conn.recv(64).startswith(b"+PONG")


def _answers_200(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT) as response:
        return bool(response.status == 200)


def healthy(urls: Sequence[str]) -> bool:
    for url in urls:
        probe = _answers_ping if url.startswith("redis://") else _answers_200
        try:
            if probe(url):
                return True
        except (OSError, ValueError):  # refused, reset, timed out, HTTP error status, bad URL
            continue
    return False


if __name__ == "__main__":
    sys.exit(0 if healthy(sys.argv[1:] or DEFAULT_URLS) else 1)
