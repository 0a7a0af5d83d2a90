"""``layered-cache warm`` into a ``tags = true`` namespace: a line's ``tags`` are written
with its entry, so ``invalidate_tag`` reaches a warmed list page; a member warm does not
take (a misspelt ``vaule``, a ``ttl``) is a numbered failure, never silently dropped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from layered_cache.cli import main
from tests.helpers import make_config, open_cache
from tests.test_cli import write_config

CATEGORY = '[namespaces.category]\nkey = "category:{slug}"\ntags = true\n'


def _jsonl(path: Path, *lines: object) -> str:
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n"
                            for line in lines))
    return str(path)


async def test_a_warmed_list_page_carries_its_tags_and_dies_with_invalidate_tag(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix, extra=CATEGORY))
    source = _jsonl(
        tmp_path / "pages.jsonl",
        {"key": {"slug": "sci-fi"}, "value": ["book 42 at 9.90"], "tags": ["book:42", "book:7"]},
        {"key": {"slug": "poetry"}, "value": ["book 9 at 5.00"], "tags": ["book:9"]},
        {"key": {"slug": "empty"}, "value": []},
    )
    args = ["warm", "category", "--from", source, "--config", config]
    assert await asyncio.to_thread(main, args) == 0
    assert "warmed 3 of 3 category entries" in capsys.readouterr().out
    namespaces = {"category": {"key": "category:{slug}", "tags": True}}
    async with open_cache(make_config(redis_url, prefix, namespaces)) as cache:
        await cache.invalidate_tag("book:42")
        served = [await cache.get("category", {"slug": s}) for s in ("sci-fi", "poetry", "empty")]
    assert served == [None, ["book 9 at 5.00"], []]


def test_warm_refuses_a_line_with_a_member_it_does_not_take_or_tags_set_would_refuse(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(write_config(tmp_path, redis_url, prefix, extra=CATEGORY))
    source = _jsonl(
        tmp_path / "odd.jsonl",
        {"key": {"slug": "a"}, "value": 1, "vaule": 2},
        {"key": {"slug": "b"}, "value": 1, "ttl": 60},
        {"key": {"slug": "c"}, "value": 1, "tags": "book:42"},
        {"key": {"slug": "d"}, "value": 1, "tags": ["book 42"]},
        {"key": {"slug": "e"}, "value": 1, "tags": [42]},
        {"key": {"slug": "f"}, "value": 1, "tags": ["book:42"]},
    )
    assert main(["warm", "category", "--from", source, "--config", config]) == 1
    err = capsys.readouterr().err
    assert f"{source}:1: unknown member(s) ['vaule']" in err
    assert f"{source}:2: unknown member(s) ['ttl']" in err
    assert f"{source}:3: tags must be a list of strings" in err
    assert f"{source}:4: tags: tag 'book 42'" in err and f"{source}:5: tags: " in err
    assert f"{source}:6:" not in err
    # a namespace without tags = true takes none, as set(tags=) refuses them
    book = _jsonl(tmp_path / "book.jsonl", {"key": {"id": 1}, "value": 1, "tags": ["book:1"]})
    assert main(["warm", "book", "--from", book, "--config", config]) == 1
    assert f"{book}:1: tags: namespace 'book' takes no tags" in capsys.readouterr().err


async def test_warm_keeps_the_last_line_of_a_key_when_an_earlier_one_had_tags(
    tmp_path: Path, redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The chunk's untagged lines went first in one set_many, its tagged ones after: an
    earlier tagged line of a key overwrote a later untagged one, and the run said every
    line was warmed."""
    config = str(write_config(tmp_path, redis_url, prefix, extra=CATEGORY))
    source = tmp_path / "pages.jsonl"
    lines = [
        {"key": {"slug": "sci-fi"}, "value": ["old page"], "tags": ["book:42"]},
        {"key": {"slug": "sci-fi"}, "value": ["new page"]},  # the file's last word
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["warm", "category", "--from", str(source), "--config", config, "--concurrency", "1"]
    assert await asyncio.to_thread(main, args) == 0
    assert "warmed 2 of 2 category entries" in capsys.readouterr().out
    namespaces = {"category": {"key": "category:{slug}", "tags": True}}
    async with open_cache(make_config(redis_url, prefix, namespaces)) as cache:
        assert await cache.get("category", {"slug": "sci-fi"}) == ["new page"]
