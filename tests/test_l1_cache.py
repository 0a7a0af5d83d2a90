"""L1Cache on its own: the races between cachetools' clock and an invalidation."""

from __future__ import annotations

from layered_cache._l1 import MISSING, L1Cache


class SteppingClock:
    """A clock that, once ``step`` is set, moves forward on every reading: each of
    cachetools' own timer calls then sees a later time than the one before."""

    def __init__(self) -> None:
        self.now = 0.0
        self.step = 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now


def test_an_entry_expiring_while_an_invalidation_drops_it_is_dropped_without_error() -> None:
    # The CI failure this pins: ``key in entries`` saw the entry alive, the clock moved
    # past its expiry, and TLRUCache's ``del`` then raised KeyError out of invalidate().
    clock = SteppingClock()
    l1 = L1Cache(max_entries=10, timer=clock)
    read_seq = l1.begin_read()
    assert l1.put("book:1", {"v": 1}, ttl=10.0)
    clock.now, clock.step = 9.5, 1.0  # alive at the next reading, expired at the one after

    l1.discard(["book:1"])

    clock.step = 0.0
    assert l1.get("book:1") is MISSING
    # The tombstone was still left: a fill that began before the invalidation is refused.
    assert not l1.put("book:1", {"v": 0}, ttl=10.0, read_seq=read_seq)
    assert l1.get("book:1") is MISSING


def test_an_invalidation_counts_only_the_entries_it_found_alive() -> None:
    clock = SteppingClock()
    l1 = L1Cache(max_entries=10, timer=clock)
    l1.put("book:1", {"v": 1}, ttl=5.0)
    l1.put("book:2", {"v": 2}, ttl=20.0)
    clock.now = 10.0

    assert l1.discard(["book:1", "book:2", "book:3"]) == 1
    assert l1.get("book:2") is MISSING


def test_a_write_replaces_each_entry_in_one_pass_and_refuses_fills_begun_before_it() -> None:
    """``replace_many`` (a write's L1 step): each entry its own TTL, read on one clock
    reading; a key invalidated since the write began and a TTL already spent are
    dropped, not stored; a full cache stores new keys only as far as it has room (a
    write evicts nothing that reads put there); and a fill that began before it (it may
    carry the value the write replaced) is refused, also of a key it didn't store."""
    clock = SteppingClock()
    l1 = L1Cache(max_entries=3, timer=clock)
    l1.put("book:0", "kept?", ttl=100.0)
    l1.put("book:3", "old three", ttl=100.0)
    read_seq = l1.begin_read()
    l1.put("book:2", "someone else's", ttl=100.0)
    l1.discard(["book:2"])  # invalidated while the batch's write was in flight
    l1.put("book:2", "refilled since", ttl=100.0)
    fill_seq = l1.begin_read()  # a load that read L2 while the write was in flight
    clock.step = 1.0  # every reading of the clock moves it: one reading for the batch
    items = [("book:1", "one", 5.0), ("book:2", "two", 5.0), ("book:3", "three", 0.0),
             ("book:4", "four", 50.0), ("book:5", "five", 50.0)]
    assert l1.replace_many(items, read_seq) == 1  # book:2 was overtaken
    clock.step = 0.0
    # book:2 and book:3 dropped left room for two: book:1 and book:4; book:0 stays.
    assert [l1.get(f"book:{i}") for i in range(6)] == ["kept?", "one", MISSING, MISSING,
                                                       "four", MISSING]
    expiries = [l1.remaining_ttl(f"book:{i}") for i in (1, 4)]
    assert expiries[1] - expiries[0] == 45.0  # type: ignore[operator]
    assert not l1.put("book:4", "what the load read", ttl=50.0, read_seq=fill_seq)
    assert not l1.put("book:5", "what the load read", ttl=50.0, read_seq=fill_seq)
    assert l1.get("book:4") == "four" and l1.get("book:5") is MISSING


def test_a_write_into_a_full_l1_replaces_what_it_holds_and_evicts_nothing() -> None:
    """Writes don't allocate in a full L1: a key it holds takes its new value, a new key
    is not stored (the value is in L2; the first read brings it back), and nothing that
    reads put there is evicted for a write (a bulk write of 100 new keys flushed 100 of
    them, at ~3.5 us each in cachetools' eviction)."""
    l1 = L1Cache(max_entries=3)
    for i in range(3):
        l1.put(f"hot:{i}", f"read {i}", ttl=100.0)
    items = [("hot:1", "new 1", 100.0)] + [(f"new:{i}", i, 100.0) for i in range(100)]
    assert l1.replace_many(items, l1.begin_read()) == 0
    assert [l1.get(f"hot:{i}") for i in range(3)] == ["read 0", "new 1", "read 2"]
    assert all(l1.get(f"new:{i}") is MISSING for i in range(100))
    assert l1.put("new:7", 7, ttl=100.0)  # a read of it allocates (evicting the LRU)
    assert l1.get("new:7") == 7 and len(l1) == 3


def test_a_write_stores_new_keys_once_expired_entries_made_room() -> None:
    clock = SteppingClock()
    l1 = L1Cache(max_entries=2, timer=clock)
    l1.put("old:1", "x", ttl=1.0)
    l1.put("old:2", "y", ttl=1.0)
    clock.now = 5.0  # both expired, not yet removed
    assert l1.replace_many([("a", "A", 10.0), ("b", "B", 10.0)], l1.begin_read()) == 0
    assert (l1.get("a"), l1.get("b")) == ("A", "B")


def test_a_write_into_a_full_l1_drops_its_overtaken_keys_before_storing_the_others() -> None:
    """A write of ``a`` and ``b`` where ``b`` was overtaken (invalidated, then refilled,
    while the write was in flight): storing ``a`` first made the full L1 evict an
    unrelated entry that dropping ``b`` would have made room for."""
    l1 = L1Cache(max_entries=2)
    l1.put("other", "kept", ttl=100.0)
    l1.discard(["a", "b"])  # the write begins
    read_seq = l1.begin_read()
    l1.discard(["b"])  # an invalidation of b overtakes it...
    l1.put("b", "reloaded", ttl=100.0, read_seq=l1.begin_read())  # ...and a read refills b
    assert l1.replace_many([("a", "A", 100.0), ("b", "B", 100.0)], read_seq) == 1
    assert [l1.get(key) for key in ("a", "b", "other")] == ["A", MISSING, "kept"]
