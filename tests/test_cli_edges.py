"""The `layered-cache` CLI's rough edges a new user hits (issue 16): output into a closed
pipe, the replica list of `inspect`, static keys in `hotkeys`, namespaces that are never
cached, and `warm`'s progress when stderr is not a terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.test_cli import ROOT, write_config


def _cli_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LAYERED_CACHE_REDIS_URL", None)
    return env


# -- a closed pipe ---------------------------------------------------------------------


def test_config_check_into_a_pipe_whose_reader_is_gone_exits_quietly(tmp_path: Path) -> None:
    # The reader closes before the first write (as `| head -1` does once it has its
    # line): every write gets EPIPE, deterministically.
    config = write_config(tmp_path, "redis://127.0.0.1:6379/0", "")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "layered_cache", "config", "check", str(config)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=_cli_env(),
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert result.returncode == 141


def test_config_check_piped_into_head_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    # Far more output than a pipe holds, so the CLI is still writing when head exits.
    extra = "".join(f'\n[namespaces.n{i}]\nkey = "n{i}:{{id}}"\n' for i in range(1500))
    config = write_config(tmp_path, "redis://127.0.0.1:6379/0", "", extra)
    command = f"{sys.executable} -m layered_cache config check {config} | head -1"
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=_cli_env(),
    )
    assert result.returncode == 0
    assert result.stdout == f"{config}: OK (1503 namespaces, 0 event routes)\n"
    assert result.stderr == ""
