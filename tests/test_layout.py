"""The size limits that keep each module readable in one sitting: no module over 400
lines, no class over 250, no function over 50. A module that grows past them has
picked up a second job; split it rather than raise the limit."""

from __future__ import annotations

import ast
from pathlib import Path

ROOTS = [Path(__file__).parent.parent / name for name in ("layered_cache", "consumers")]
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 400, 250, 50


def _sources() -> list[Path]:
    return sorted(path for root in ROOTS for path in root.rglob("*.py"))


def _too_long() -> list[str]:
    found: list[str] = []
    for path in _sources():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE:
            found.append(f"{path}: module of {lines} lines")
        for node in ast.walk(ast.parse(source)):
            limit = (
                MAX_CLASS
                if isinstance(node, ast.ClassDef)
                else MAX_FUNCTION
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                else None
            )
            if limit is None or node.end_lineno is None:
                continue
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_class_or_function_exceeds_its_size_limit() -> None:
    assert _too_long() == []


def test_the_check_sees_every_module() -> None:
    names = {path.name for path in _sources()}
    assert {"_cache.py", "_namespace.py", "core.py", "__init__.py"} <= names
