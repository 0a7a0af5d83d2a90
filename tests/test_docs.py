"""The docs a new user reads first agree with the code: the files they name exist, the
README's configuration table has a row for every setting, examples print what they say."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import msgspec

from layered_cache._config import schema

ROOT = Path(__file__).resolve().parent.parent
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
