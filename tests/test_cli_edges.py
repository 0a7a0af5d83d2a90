"""The `layered-cache` CLI's rough edges a new user hits (issue 16): output into a closed
pipe, the replica list of `inspect`, static keys in `hotkeys`, namespaces that are never
cached, and `warm`'s progress when stderr is not a terminal."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from layered_cache import LayeredCache, load_config
from layered_cache._warm import Progress
from layered_cache.cli import main
from tests.helpers import eventually
from tests.test_cli import ROOT, envelope, write_config
from tests.test_cli import admin as admin  # the fixture, shared with test_cli.py


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


# -- inspect ---------------------------------------------------------------------------


def test_inspect_marks_every_replica_with_its_hash(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix))
    base = f"{prefix}book:42"
    for index in (0, 2, 3):
        admin.set(f"{base}#{index}", envelope({"title": "Dune"}), px=590_000)
    assert main(["inspect", "book", "id=42", "--config", config]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("replicas"))
    assert re.fullmatch(r"replicas   3/4 exist: #0 \(\S+\), #2 \(\S+\), #3 \(\S+\)", line), line


# -- hotkeys ---------------------------------------------------------------------------


async def test_hotkeys_lists_a_static_key_once_not_again_as_detected(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Instances report their static keys with the detected ones (rate 0: detection
    # never counts them): book:1 and author:1 must not come back as "detected hot, 0
    # reads/s"; author:7, read as steadily but not static, must.
    extra = (
        '\n[namespaces.author]\nkey = "author:{id}"\nl1 = false\n'
        'hot = { replicas = 4, threshold = "20/s", window = "500ms", keys = ["author:1"] }\n'
    )
    path = write_config(tmp_path, redis_url, prefix, extra)
    async with LayeredCache.from_config(load_config(path, env={})) as cache:

        async def loader() -> str:
            return "Wislawa"

        async def steady_reads(author: int) -> None:  # ~100 L2 reads/s, far above 20/s
            while True:
                await cache.get_or_load("author", {"id": author}, loader)
                await asyncio.sleep(0.01)

        async def reported() -> bool:  # detection, then the reporter (about once a second)
            code = await asyncio.to_thread(main, ["hotkeys", "--config", str(path), "--json"])
            assert code == 0
            # This process's own cache logs to stdout until something configures logging
            # (run alone, its first lines preceded the JSON): the report starts at "{".
            out = capsys.readouterr().out
            report.update(json.loads(out[out.index("\n{") + 1 :] if not out.startswith("{") else out))
            return bool(report["author"]["detected"])

        report: dict[str, Any] = {}
        reads = [asyncio.create_task(steady_reads(author)) for author in (1, 7)]
        assert await eventually(reported, timeout=20, interval=0.3)
        text_code = await asyncio.to_thread(main, ["hotkeys", "--config", str(path)])
        for task in reads:
            task.cancel()
    assert text_code == 0
    text = capsys.readouterr().out
    assert report["book"]["detected"] == []
    assert [entry["key"] for entry in report["book"]["static"]] == [f"{prefix}book:1"]
    assert [hot["key"] for hot in report["author"]["detected"]] == [f"{prefix}author:7"]
    assert [entry["key"] for entry in report["author"]["static"]] == [f"{prefix}author:1"]
    assert "detected hot, 0 L2 reads/s" not in text
    assert text.count(f"{prefix}author:1:") == 1 and text.count(f"{prefix}book:1:") == 1
    assert f"{prefix}author:7: detected hot" in text


# -- namespaces that are never cached --------------------------------------------------


def test_inspect_and_invalidate_of_a_never_cached_namespace_exit_2_saying_so(
    tmp_path: Path, redis_url: str, prefix: str, admin: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    l1_only = '\n[namespaces.session]\nkey = "session:{id}"\nl2 = false\n'
    config = str(write_config(tmp_path, redis_url, prefix, l1_only))
    for command in ("inspect", "invalidate"):
        assert main([command, "stock", "id=3", "--config", config]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert "namespace 'stock' is never cached (cache = false)" in captured.err
        assert f"nothing to {command}" in captured.err
    # nothing was announced as if a key had been invalidated
    assert admin.exists(f"{prefix}layered_cache:invalidations") == 0

    # l2 = false: Redis holds nothing to inspect, but invalidate drops L1 everywhere
    assert main(["inspect", "session", "id=3", "--config", config]) == 2
    assert "has no L2 (l2 = false)" in capsys.readouterr().err
    assert main(["invalidate", "session", "id=3", "--config", config]) == 0
    assert "announced on the backplane" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "invalidate"])
def test_a_key_field_of_5000_digits_is_a_one_line_error_naming_the_field(
    tmp_path: Path, redis_url: str, prefix: str, command: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Python's int() refuses more than 4,300 digits: the message was its own, naming
    sys.set_int_max_str_digits and neither the field nor the namespace."""
    config = str(write_config(tmp_path, redis_url, prefix))
    assert main([command, "book", "id=" + "9" * 5000, "--config", config]) == 2
    err = capsys.readouterr().err
    assert "field 'id': a number of 5,000 digits" in err and "Traceback" not in err


# -- warm's progress -------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_warm_progress_redraws_one_line_only_on_a_terminal() -> None:
    terminal = _Terminal()
    progress = Progress(1000, "warm book", terminal)
    for position in range(0, 1001, 10):
        progress.update(position, position // 10, position // 10 + 1, force=True)
    progress.finish()
    assert terminal.getvalue().count("\r") == 101 and terminal.getvalue().count("\n") == 1

    log = io.StringIO()  # a file, a pipe, CI: plain lines, about one per tenth of the file
    progress = Progress(1000, "warm book", log)
    progress.update(0, 0, 1, force=True)
    for position in range(10, 1001, 10):
        progress.update(position, position // 10, position // 10 + 1)
    progress.update(1000, 100, 101, force=True)
    progress.finish()
    lines = log.getvalue().splitlines(keepends=True)
    assert "\r" not in log.getvalue() and all(line.endswith("\n") for line in lines)
    assert lines[0] == "warm book: 0%, line 1, 0 warmed, 0/s\n"
    # One 100 % line: the last one said it already, and the final one said it again (a
    # new user's review, 2026-12-05: the docs promise "the first, one per 10 %, the last").
    assert [line.split(",")[0] for line in lines[1:]] == [
        *(f"warm book: {tenth}0%" for tenth in range(1, 10)), "warm book: 100%"
    ]


def test_warm_into_a_log_file_writes_plain_progress_lines(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    config = write_config(tmp_path, redis_url, prefix)
    source = tmp_path / "books.jsonl"
    source.write_text("".join(f'{{"key": {{"id": {i}}}, "value": {i}}}\n' for i in range(500)))
    result = subprocess.run(
        [sys.executable, "-m", "layered_cache", "warm", "book", "--from", str(source),
         "--config", str(config)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=_cli_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("warm book: 0%, line 1, 0 warmed")
    assert lines[-1].startswith("warm book: 100%, line 501, 500 warmed")
    assert len(lines) <= 12


def test_warm_from_dash_reads_standard_input(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """``--from -`` is standard input, as most tools read it (``zcat x.gz | ... --from -``):
    it was refused, "-: cannot read: No such file or directory" (a new user's review)."""
    config = write_config(tmp_path, redis_url, prefix)
    lines = "".join(f'{{"key": {{"id": {i}}}, "value": {i}}}\n' for i in range(5))
    result = subprocess.run(
        [sys.executable, "-m", "layered_cache", "warm", "book", "--from", "-",
         "--config", str(config)],
        input=lines, capture_output=True, text=True, timeout=60, cwd=ROOT, env=_cli_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "warmed 5 of 5 book entries" in result.stdout
    assert "%" not in result.stderr  # a pipe has no size: counts, no percentage


def test_warm_progress_from_a_pipe_shows_counts_without_a_percentage() -> None:
    """A pipe (``--from /dev/stdin``, ``<(zcat ...)``) has no size: the bar said 100%
    from the first line, and in a log no line came after it for 30 s."""
    terminal = _Terminal()
    progress = Progress(0, "warm book", terminal)
    progress.update(500, 499, 501, force=True)
    assert terminal.getvalue().startswith("\rwarm book line 501, 499 warmed, ")
    assert "%" not in terminal.getvalue() and "[" not in terminal.getvalue()
    log = io.StringIO()
    progress = Progress(0, "warm book", log)
    progress.update(0, 0, 1, force=True)
    progress.update(500, 499, 501)  # not due: no size to report tenths of
    assert log.getvalue() == "warm book: line 1, 0 warmed, 0/s\n"


def test_warm_resumed_at_the_end_of_its_file_still_writes_its_last_progress_line() -> None:
    """92ced5e. docs/cli.md: plain progress lines are "the first, one per 10 % of the file,
    one at least every 30 s, and the last". Scenario: ``warm --start-line 4`` on a file of
    3 lines (the resume line a run interrupted after its last write printed): the first
    line is ``0%, line 4, 0 warmed``; the reader then skips the 3 lines (position at the
    end) and the final update is ``100%, line 4, 0 warmed``. Actual: only the 0 % line;
    the dedupe in ``Progress.update`` (layered_cache/_progress.py) compares (line, warmed)
    only, not the percentage, and drops a last line that says something else."""
    import io

    from layered_cache._warm import Progress

    log = io.StringIO()
    progress = Progress(99, "warm book", log)
    progress.update(0, 0, 4, force=True)  # Warmer.run: the first line
    progress.update(99, 0, 4, force=True)  # Warmer.run: the last (every line skipped)
    progress.finish()
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["warm book: 0%", "warm book: 100%"], lines


def test_warm_from_dash_with_stdin_closed_is_one_clear_error(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """3a436b5. ``warm --from -`` run with standard input closed (``0<&-``, a daemon, a
    cron job, ``nohup`` under some shells): Python sets ``sys.stdin`` to None. Expected: one
    line on stderr and exit 2, as for an unreadable file ("FILE: cannot read: ...").
    Actual: ``cmd_warm`` (layered_cache/cli/warm.py:139) calls ``sys.stdin.fileno()``:
    AttributeError, not caught (only OSError is), a traceback."""
    config = write_config(tmp_path, redis_url, prefix)
    result = subprocess.run(
        ["/bin/sh", "-c", 'exec "$0" -m layered_cache warm book --from - --config "$1" 0<&-',
         sys.executable, str(config)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=_cli_env(),
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)


def test_warm_from_dash_on_a_terminal_is_refused_at_once(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """``warm book --from -`` with standard input a terminal: the reader's ``readline``
    blocked the event loop, so Ctrl-C went unheard until more input or Ctrl-D (a review
    of 3a436b5). Lines are meant to be piped in: a terminal is refused, one line, exit 2."""
    import os
    import pty

    config = write_config(tmp_path, redis_url, prefix)
    controller, terminal = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "layered_cache", "warm", "book", "--from", "-",
             "--config", str(config)],
            stdin=terminal, capture_output=True, text=True, timeout=30, cwd=ROOT,
            env=_cli_env(),
        )  # fmt: skip
    finally:
        os.close(terminal)
        os.close(controller)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.strip() == (
        "layered-cache: error: -: standard input is a terminal: pipe the JSONL into it"
    )
