"""A throwaway Varnish (``varnishd -F``) in front of a test's app, with the VCL of
deploy/varnish/default.vcl pointed at the app's port (tests/servers.py style).

``make test`` installs Varnish when missing (deploy/local/ensure-varnish.sh); where it
can't be installed the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from tests.servers import ManagedProcess

VCL = Path(__file__).parent.parent / "deploy" / "varnish" / "default.vcl"


def varnishd_binary() -> str | None:
    return shutil.which("varnishd") or next(
        (p for p in ("/usr/sbin/varnishd", "/usr/local/sbin/varnishd") if Path(p).exists()), None
    )


class VarnishServer(ManagedProcess):
    """Varnish on 127.0.0.1 caching ``backend_port``; purges accepted from localhost."""

    name = "varnish"

    def __init__(self, backend_port: int) -> None:
        super().__init__()
        self.backend_port = backend_port
        self.dir.chmod(0o755)  # varnishd's workers run as an unprivileged user

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        binary = varnishd_binary()
        assert binary is not None, "varnishd is not installed"
        vcl = self.dir / "default.vcl"
        vcl.write_text(
            VCL.read_text().replace('.port = "8000";', f'.port = "{self.backend_port}";')
        )
        return [
            binary, "-F", "-a", f"{self.host}:{self.port}", "-f", str(vcl),
            "-n", str(self.dir / "n"), "-s", "malloc,32m",
            # Tests measure freshness: the ban lurker must not wait long between rounds.
            "-p", "ban_lurker_sleep=0.01",
        ]  # fmt: skip

    def ready(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=0.5) as conn:
            conn.sendall(b"BAN / HTTP/1.0\r\n\r\n")  # answered by the VCL itself: 400
            return conn.recv(12).startswith(b"HTTP/1.1 400")
