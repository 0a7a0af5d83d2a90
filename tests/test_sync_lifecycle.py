"""The sync API's life around its loop thread: what close() leaves behind for the
process's exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# A script that meets a database that hangs: its call times out, it closes the cache and
# has nothing left to do.
_EXIT_AFTER_A_HUNG_LOADER = """
import os, time
from layered_cache.sync import SyncLayeredCache, SyncTimeoutError
from tests.helpers import make_config

cache = SyncLayeredCache.from_config(
    make_config(os.environ["LC_REDIS_URL"], os.environ["LC_PREFIX"]), timeout=0.5
)
cache.start()
try:
    cache.get_or_load("book", {"id": 1}, lambda: time.sleep(60) or "v")
except SyncTimeoutError:
    pass
cache.close()
print("closed", flush=True)
"""


def test_a_process_exits_after_close_while_a_loader_its_caller_gave_up_on_still_hangs(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """README: "No call waits forever", and a caller that times out leaves its loader
    running. The pool's threads were a ``ThreadPoolExecutor``'s, which the interpreter
    joins at exit: a management command that met a hung database was told after its
    timeout, closed the cache, and then hung at exit as long as the database did. They
    are daemon threads now, like the overflow and nested loaders' threads."""
    script = tmp_path / "exit_after_hung_loader.py"
    script.write_text(_EXIT_AFTER_A_HUNG_LOADER)
    env = {**os.environ, "LC_REDIS_URL": redis_url, "LC_PREFIX": prefix, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"still running {time.monotonic() - started:.0f} s on: {output[-300:]!r}")
    assert proc.returncode == 0 and b"closed\n" in output, output[-500:]
