"""How the daemon takes its dead-letter topic's answers: an ``UnknownError`` (what
aiokafka makes of INVALID_RECORD, never passing, and of UNKNOWN_SERVER_ERROR, which may
pass) refuses a copy for good only after answering every attempt for a while, and only
in a row. Three quick answers of a broker's hiccup set a copy aside, and its original
was committed with no trace (found by a review, 2026-12-05). Scripted producers: the
broker can't be made to answer so on cue."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from aiokafka.errors import KafkaTimeoutError, UnknownError

from layered_cache.daemon.dlq import DeadLetters, Poison, dead_letter
from layered_cache.daemon.retry import Retrier
from layered_cache.daemon.stats import DaemonStats
from tests.helpers import make_config


class _HiccupProducer:
    """A DLQ producer whose broker answers UNKNOWN_SERVER_ERROR for its first ``bad``
    produce requests (a short broker-side hiccup), then accepts everything."""

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.requests = 0
        self.written: list[bytes] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    async def send(self, topic: str, value: bytes, key: Any = None, headers: Any = None) -> Any:
        self.requests += 1
        future = asyncio.get_running_loop().create_future()
        if self.requests <= self.bad:
            future.set_exception(UnknownError())  # what aiokafka makes of error code -1
        else:
            self.written.append(value)
            future.set_result(None)
        return future


def _poison() -> Poison:
    return Poison(
        topic="catalog-events",
        partition=0,
        offset=7,
        timestamp=0,
        key=None,
        value=b"not json",
        headers=(),
        reason="not JSON",
        event_type=None,
    )


async def test_a_dead_letter_answered_unknown_server_error_for_half_a_second_is_still_written(
    prefix: str,
) -> None:
    config = make_config("redis://127.0.0.1:1/0", prefix)
    stats = DaemonStats()
    retrier = Retrier(asyncio.Event(), stats, max_backoff=5.0)
    producer = _HiccupProducer(bad=3)
    letters = DeadLetters([_poison()])
    attempt = partial(dead_letter, producer, config.kafka, letters, stats)
    started = asyncio.get_running_loop().time()
    done = await asyncio.wait_for(retrier.until_done("dead_letter", attempt, (Exception,)), 30)
    took = asyncio.get_running_loop().time() - started
    assert done  # the batch goes on to its commit either way
    # The hiccup lasted 3 requests (well under a second): the copy must be on the DLQ
    # before the original is committed, not set aside as refused for good.
    assert producer.written == [b"not json"], (
        f"dead letter set aside after {took:.2f}s of UnknownError "
        f"(rejected={stats.dead_letters_rejected}, written={stats.dead_letters})"
    )
    assert (stats.dead_letters, stats.dead_letters_rejected) == (1, 0)


class _ScriptedProducer:
    """Answers each produce request with the next of ``answers`` (None: accepted)."""

    def __init__(self, answers: list[BaseException | None]) -> None:
        self.answers = answers
        self.written: list[bytes] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    async def send(self, topic: str, value: bytes, key: Any = None, headers: Any = None) -> Any:
        answer = self.answers.pop(0) if self.answers else None
        future = asyncio.get_running_loop().create_future()
        if answer is None:
            self.written.append(value)
            future.set_result(None)
        else:
            future.set_exception(answer)
        return future


async def test_unknown_errors_split_by_a_timeout_are_not_three_in_a_row(prefix: str) -> None:
    config = make_config("redis://127.0.0.1:1/0", prefix)
    stats = DaemonStats()
    retrier = Retrier(asyncio.Event(), stats, max_backoff=0.05)
    producer = _ScriptedProducer(
        [UnknownError(), KafkaTimeoutError(), UnknownError(), UnknownError(), None]
    )
    poison = Poison("catalog-events", 0, 7, 0, None, b"not json", (), "not JSON", None)
    letters = DeadLetters([poison])
    attempt = partial(dead_letter, producer, config.kafka, letters, stats)
    assert await asyncio.wait_for(retrier.until_done("dead_letter", attempt, (Exception,)), 30)
    # Never 3 UnknownErrors in a row: the fifth attempt is accepted and the copy written.
    assert producer.written == [b"not json"], stats
    assert stats.dead_letters_rejected == 0
