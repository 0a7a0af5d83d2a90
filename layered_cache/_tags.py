"""Tags: derived entries (a category page, a search result) die with what they contain.

Design (chosen over a set of member keys per tag; docs/tags.md has the measurements):

- **A version per tag.** ``{prefix}layered_cache:tag:<tag>`` holds a random token. A
  tagged entry carries ``{tag: token}`` in its envelope, read when it was loaded.
  ``invalidate_tag`` writes a new token: every entry carrying the old one is dead at
  once, in L2 and every replica, whatever their number. O(1) round trips.
- **Reads check versions locally.** Each instance keeps the tokens it has seen
  (``TagVersions``) and learns new ones from the backplane, exactly as L1 learns about
  deleted keys, so an L2 hit of a tagged entry costs no extra round trip and a tag
  invalidation reaches every instance within the backplane's bound. A token this
  instance has never seen is fetched once (one round trip per tag per instance); a
  reader makes no token key, and a tag it finds without one is dead here for
  ``_ABSENT_FOR`` before it asks again.
- **Only while the backplane vouches.** A held token is current only as long as every
  invalidation since its fetch has reached this instance: the listener says as of when
  that is so (``vouch_with``). When it can't (backplane off, listener disconnected or
  stalled), a namespace trusts a token for its L1 TTL after the fetch and then asks
  Redis again (``NamespaceVersions``): a tag invalidation that hasn't reached an
  instance stops its dead entries' L2 copies within the bound its key invalidations
  have (their L1 copies), not after the hour a token is otherwise held. Their L1
  copies live the L1 TTL counted from that last word or fetch (``unvouched_for``).
- **Loads in flight can't land after an invalidation.** A tagged load registers its
  lease (with its token) in ``{prefix}layered_cache:loading`` before it calls the
  loader (its tags come from the loaded value, so they aren't known before).
  ``invalidate_tag`` revokes the leases of the set (``take_loading``), then writes the new
  token: a fill whose load began before the invalidation either lands before the
  revocation, with the token it fetched before the new one was written (dead once it
  is), or finds its lease gone and writes nothing; a load that registered after the
  set was read began after the change that caused the invalidation.
- **L1** keeps an index tag -> keys per namespace; an invalidation (local or from the
  backplane) drops those keys, and an L1 fill whose tokens are no longer current is
  refused, so a fill racing the invalidation can't outlive it either.

A missing token key (evicted, deleted by hand) kills every entry of its tag, never back
to life: a reader takes them for dead, and the next writer makes a new random token.

**Token keys expire** (``version_ttl``): else tags of unbounded kinds (a search query,
a user) fill Redis, unevictable under ``volatile-*``. A key lives ``version_ttl`` after
its last fetch or invalidation: a day at least, twice the longest tagged entry's life
(L2 TTL + jitter + stale window), so a token outlives its entries. An instance trusts a
token for a quarter of that (an hour at most), then fetches it again (extending its
life): one holding a token Redis no longer has would take every newer entry for dead.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from layered_cache._chunks import by_count
from layered_cache._codec import MAX_TAGS
from layered_cache._keys import is_tag, tag_version_name, validate_tag
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache._loading import take_loading
from layered_cache._memory_policy import refused_for_memory
from layered_cache._replyerrors import moving_as_replies
from layered_cache._scripts import FETCH_SCRIPT, PEEK_SCRIPT
from layered_cache._tag_args import TagsOf, entry_tags, tag_names
from layered_cache._tag_ttl import VERSION_TTL_FLOOR, version_ttl

# ``TagsOf``, ``tag_names`` and ``entry_tags`` (the ``tags=`` argument) live in
# ``_tag_args``, ``version_ttl`` in ``_tag_ttl``; importable from here, as before.
__all__ = [
    "MAX_TAGS",
    "VERSION_TTL_FLOOR",
    "TagVersions",
    "TagsOf",
    "entry_tags",
    "invalidate_tags",
    "tag_names",
    "version_ttl",
]

_LIMIT = 65_536  # tags remembered per instance; past it, forget all (they're refetched)
# How long a reader takes a tag it found without a version key for dead without asking
# Redis again: readers make no key, so an entry carrying such a tag (its key lost, or
# planted with made-up tags) cost a round trip on every read (1,000 EVALs per read of a
# 1,000-tag plant; found by an adversarial review). The price: for as long, this
# instance refuses entries a writer elsewhere writes with the tag's new key (a get()
# misses; a get_or_load loads, and its write fetches the key, which ends the wait).
_ABSENT_FOR = 5.0

# The longest a token is trusted without asking Redis: what a lost token (evicted) costs
# is loads until every instance asks again, so not a quarter of a 30-day entry's life.
_MAX_TRUST = 3_600.0
# ``within``: trust a held token as long as it is held (its horizon, minus infinity,
# is vouched for by anything: ``_aged`` finds none).
_HELD = float("inf")


def _nothing_vouched() -> float:
    return float("-inf")


def _writable(tags: Mapping[str, str]) -> bool:
    """Whether a writer could have given these tags (``validate_tag``): if not, the
    envelope was planted, and none of its tags is fetched. (Their number is bounded
    where an envelope is decoded: ``_codec.MAX_TAGS``.)"""
    return all(is_tag(tag) for tag in tags)


def new_version() -> str:
    return os.urandom(8).hex()


_TOKEN = re.compile(r"[0-9a-f]{16}")


def _token(raw: object) -> str | None:
    """A fetched token, or None for none, or for what no writer of ours made (another
    client's string, bytes that aren't UTF-8: read as a tag without a token, its
    entries dead; a writer's fetch replaces it, ``FETCH_SCRIPT``)."""
    if raw is None:
        return None
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    return text if _TOKEN.fullmatch(text) else None


class TagVersions:
    """This instance's view of tag versions: only ever what Redis held when read.

    An invalidation (ours, or another's via the backplane) makes this instance *forget*
    the tag rather than adopt the version it carries: two invalidations of one tag may
    reach us in the other order than Redis applied their SETs, and adopting the last
    one delivered could leave us on a version Redis no longer holds. The next read of
    the tag fetches the version Redis holds now (one round trip). A fetch whose reply
    raced an invalidation of its tag is not remembered: it may predate it."""

    def __init__(
        self,
        store: L2Store,
        prefix: str,
        ttl: float = VERSION_TTL_FLOOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._ttl_ms = int(ttl * 1000)
        self._trust = min(ttl / 4, _MAX_TRUST)  # the module doc says why a quarter
        self._clock = clock
        self._trusted_until = clock() + self._trust
        self._versions: dict[str, str] = {}
        self._generation = 0  # bumped by every forget
        self._forgotten: dict[str, int] = {}  # tag -> generation of its last forget
        self._floor = 0  # fetches begun before this generation are not remembered
        self._absent: dict[str, float] = {}  # tag -> until when it has no key (readers)
        self._fetched_at: dict[str, float] = {}  # tag -> when its held token was fetched
        self._known_as_of: Callable[[], float] = _nothing_vouched

    def vouch_with(self, known_as_of: Callable[[], float] | None) -> None:
        """The backplane listener's word: the (monotonic) time as of which every
        invalidation has reached this instance. None: the backplane is off."""
        self._known_as_of = known_as_of or _nothing_vouched

    def _aged(self, tags: Iterable[str], within: float) -> set[str]:
        """The held ``tags`` whose token is not vouched for: fetched longer than
        ``within`` ago, with no word from the backplane since ``within`` ago either."""
        horizon = self._clock() - within
        if self._known_as_of() >= horizon:
            return set()
        fetched = self._fetched_at
        return {tag for tag in tags if fetched.get(tag, horizon) < horizon}

    @property
    def generation(self) -> int:
        """Taken before a load, for ``invalidated_since`` after it."""
        return self._generation

    def invalidated_since(self, tags: Iterable[str], generation: int) -> bool:
        """Whether one of ``tags`` was invalidated (forgotten here) after ``generation``
        was taken: a value loaded meanwhile may predate that invalidation."""
        return generation < self._floor or any(
            self._forgotten.get(tag, -1) > generation for tag in tags
        )

    def known(self, tags: Mapping[str, str], within: float = _HELD) -> bool | None:
        """True: every version is current; False: one is outdated (the entry is dead);
        None: a tag this instance hasn't seen yet, or can't vouch for (``_aged``):
        ``fetch`` it to decide."""
        versions = self._trusted()
        aged = self._aged(tags, within)
        if not aged and tags.items() <= versions.items():  # the common case, in C loops
            return True
        unknown, now = False, self._clock()
        for tag, version in tags.items():
            current = None if tag in aged else versions.get(tag)
            if current is None:
                if self._absent.get(tag, 0.0) > now:
                    return False  # found without a key moments ago (``_ABSENT_FOR``)
                unknown = True
            elif current != version:
                return False
        return None if unknown else True

    def unvouched_for(self, tags: Mapping[str, str], within: float) -> float | None:
        """For an L1 copy of an entry carrying ``tags``: None unless ``known`` says True
        (no copy), else for how long its versions have gone unvouched for: since their
        fetch, or the backplane's last word if later (0: it vouches as of now). Checked
        as ``known`` checks (a subset of the held versions, none aged): one call."""
        if not tags.items() <= self._trusted().items():
            return None
        now, vouched = self._clock(), self._known_as_of()
        if vouched >= now:  # the listener waits on a live link: the common case
            return 0.0
        fetched = self._fetched_at
        since = max(vouched, min((fetched.get(tag, vouched) for tag in tags), default=now))
        return now - since if since >= now - within else None

    async def current(self, tags: Iterable[str], within: float = _HELD) -> dict[str, str]:
        """The current version of each tag, for a writer: unknown ones fetched, or
        created, in one round trip. Raises ``L2Unavailable``."""
        return await self._lookup(tags, create=True, within=within)

    async def valid(self, tags: Mapping[str, str], within: float = _HELD) -> bool:
        """Whether an entry carrying ``tags`` is alive (fetching unknown tags; a tag
        with no token in Redis kills it, and none is created)."""
        state = self.known(tags, within)
        if state is not None:
            return state
        if not _writable(tags):
            return False  # planted in Redis: no caller could give it (``_codec.Envelope``)
        current = await self._lookup(tags, create=False, within=within)
        return all(current.get(tag) == version for tag, version in tags.items())

    async def valid_many(
        self, entries: Sequence[Mapping[str, str]], within: float = _HELD
    ) -> list[bool]:
        """``valid`` for each of many entries, every unknown tag fetched in one round
        trip (the batches)."""
        verdicts = [self.known(tags, within) for tags in entries]
        # Undecided: a tag this instance hasn't seen. A tag no caller could give is a
        # planted envelope, dead (``valid``); the rest are fetched, all at once.
        fetch = [
            i for i, verdict in enumerate(verdicts) if verdict is None and _writable(entries[i])
        ]
        unknown = {tag for i in fetch for tag in entries[i]}
        current = await self._lookup(unknown, create=False, within=within) if fetch else {}
        for i in fetch:
            verdicts[i] = all(current.get(tag) == version for tag, version in entries[i].items())
        return [verdict is True for verdict in verdicts]

    async def _lookup(
        self, tags: Iterable[str], *, create: bool, within: float
    ) -> dict[str, str]:
        """The versions of ``tags``: those held (and vouched for), the rest fetched in
        one round trip; with ``create`` (writers) a tag without one gets one, else it is
        left out."""
        wanted = [validate_tag(tag) for tag in dict.fromkeys(tags)]
        versions = self._trusted()
        aged = self._aged(wanted, within)
        found = {tag: versions[tag] for tag in wanted if tag in versions and tag not in aged}
        missing = [tag for tag in wanted if tag not in found]
        if missing:
            found.update(await self._fetch(missing, create))
        return found

    def _trusted(self) -> dict[str, str]:
        """The tokens held, forgotten every ``ttl / 4`` (an hour at most): a token is
        trusted no longer after its fetch, so Redis still holds it (the fetch extended
        the key's life) for as long as any entry written with it lives."""
        if self._clock() >= self._trusted_until:
            self._versions.clear()
            self._fetched_at.clear()
            self._trusted_until = self._clock() + self._trust
        return self._versions

    def _pipeline(self, tags: Sequence[str], create: bool) -> Any:
        pipe = self._store.client.pipeline(transaction=False)
        for tag in tags:  # its life extended; with ``create``, a new tag gets a token
            name = tag_version_name(self._prefix, tag)
            if create:
                pipe.eval(FETCH_SCRIPT, 1, name, new_version(), self._ttl_ms)
            else:
                pipe.eval(PEEK_SCRIPT, 1, name, self._ttl_ms)
        return pipe

    def _replies(self, tags: Sequence[str], create: bool) -> Awaitable[list[Any]]:
        """A reader's fetch in a cluster leaves a tag whose slot is moving unknown (its
        entries misses), not every tag of the round trip; a writer needs every version."""
        pipe = self._pipeline(tags, create)
        return moving_as_replies(pipe) if self._store.cluster and not create else pipe.execute()

    async def _fetch(self, tags: list[str], create: bool) -> dict[str, str]:
        generation, started = self._generation, self._clock()
        results: list[Any] = []
        for chunk in by_count(tags):  # one pipeline of 60,000 outlasted the timeout
            results += await self._store.guard(self._replies(chunk, create))
        moving = {t for t, reply in zip(tags, results, strict=True) if isinstance(reply, Exception)}
        fetched = {
            tag: token
            for tag, version in zip(tags, results, strict=True)
            if (token := _token(version)) is not None
        }
        # Remembered unless an invalidation of the tag was applied after this fetch began
        # (its reply may predate it); one applied before it began is in it.
        fresh = [
            tag for tag in tags
            if generation >= self._floor and self._forgotten.get(tag, -1) <= generation
        ]
        if create:  # every key asked for exists now
            for tag in tags:
                self._absent.pop(tag, None)
        else:
            self._note_absent([t for t in fresh if t not in fetched and t not in moving])
        if len(self._versions) + len(fetched) > _LIMIT:
            self._versions.clear()
            self._fetched_at.clear()
        for tag in fresh:
            if tag in fetched:
                self._versions[tag] = fetched[tag]
                self._fetched_at[tag] = started
        return fetched

    def _note_absent(self, tags: list[str]) -> None:
        """Tags a reader's fetch found without a key: dead here for ``_ABSENT_FOR``, or
        until a writer's fetch here makes their key or an invalidation reaches us."""
        if len(self._absent) + len(tags) > _LIMIT:
            self._absent.clear()
        until = self._clock() + _ABSENT_FOR
        for tag in tags:
            self._absent[tag] = until

    def apply(self, versions: Mapping[str, str]) -> None:
        """Tags invalidated (by us, or by another via the backplane): forget them."""
        self._generation += 1
        if len(self._forgotten) > _LIMIT:  # bounded: fetches begun before now are void
            self._forgotten.clear()
            self._floor = self._generation
        for tag in versions:
            self._versions.pop(tag, None)
            self._fetched_at.pop(tag, None)
            self._absent.pop(tag, None)  # it has a key now
            self._forgotten[tag] = self._generation

    def forget_all(self) -> None:
        """The backplane lost track: every remembered version may be outdated."""
        self._generation += 1
        self._versions.clear()
        self._fetched_at.clear()
        self._absent.clear()
        self._forgotten.clear()
        self._floor = self._generation

    async def invalidate(self, tag: str) -> str:
        """Write a new version for ``tag`` and revoke every tagged load in flight.
        Returns the new version (the caller announces it on the backplane). Failed, the
        tag's version is forgotten here all the same: the new one may have landed (a
        reply lost), and trusting the old one served its dead entries from L2 here."""
        try:
            versions = await invalidate_tags(self._store, self._prefix, [tag], self._ttl_ms / 1000)
        except BaseException:
            self.apply({tag: ""})  # the next read here fetches what Redis holds
            raise
        self.apply(versions)
        return versions[tag]


async def invalidate_tags(
    store: L2Store, prefix: str, tags: list[str], ttl: float = VERSION_TTL_FLOOR
) -> dict[str, str]:
    """``TagVersions.invalidate`` for many tags at once (the daemon's batches): new
    versions in one pipelined round trip, then the loading set once. Each key lives
    ``ttl`` seconds (``version_ttl``) unless an instance fetches it again."""
    versions = {validate_tag(tag): new_version() for tag in tags}
    if not versions:
        return versions
    # The loads in flight are revoked first, then the new tokens written: a fill landing
    # before the revocation fetched its token before the SETs (the old one: dead once
    # they land), one after it has no lease. The other order let a load that began before
    # the change fill between the SETs and the revocation with the new token (fetched
    # then: a tag this instance had not seen, or no longer trusted).
    await take_loading(store, prefix)
    pipe = store.client.pipeline(transaction=False)
    for tag, version in versions.items():
        pipe.set(tag_version_name(prefix, tag), version, px=int(ttl * 1000))
    try:
        await store.guard(pipe.execute())
    except L2Unavailable as exc:
        if not refused_for_memory(exc):
            raise
        # A Redis full under noeviction refuses the new tokens. A DEL needs no memory,
        # and a missing token kills every entry carrying the old one just the same (see
        # the module doc).
        await store.delete([tag_version_name(prefix, tag) for tag in versions])
    return versions
