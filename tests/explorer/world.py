"""The explorer's world: two cache instances and a daemon on one Redis, a database of
versions, and random programs of operations run under a seeded scheduler.

Operations (weights in ``_KINDS``): ``get_or_load`` and ``get`` on either instance, and
their batch forms ``get_or_load_many`` and ``get_many`` over 2-3 keys (each value one
read); writes that bump the database version and then ``invalidate()`` (on either
instance), ``set()`` the new value (write-through), or let the daemon invalidate (the
same ``Invalidator`` the daemon runs after decoding an event; Kafka adds nothing to the
ordering); in the ``tags`` variant, ``invalidate_tag`` (a version bump of every key
carrying the tag) and the daemon's tag route; cancellation of a random operation at a
random point. Loaders (single and ``load_many``) read the database at their start (their
linearisation point) and may fail, which exercises the stale fail-safe. Variants switch
on the paths that only some configs take: hot keys with replicas, short soft expiry with
stale fallback, early refresh and ``load_timeout``, no L1, tags. Redis faults are
injected at a rate drawn per schedule.

After the program, a quiet phase checks liveness: with faults off and the breaker's
reset passed, a final write must succeed on every instance and every instance must
then read the final version (a stuck breaker or a replica nobody deletes fails here).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from layered_cache import LayeredCache
from layered_cache._backplane import BackplanePublisher
from layered_cache._breaker import CircuitBreaker
from layered_cache._clients import REDIS_FAILURES, make_client
from layered_cache._config import Config
from layered_cache._invalidation import Invalidator
from layered_cache._keys import replica_names, tag_version_name
from layered_cache._l2 import L2Store, L2Unavailable
from layered_cache._relay import Relay
from layered_cache._stream import parse_id
from layered_cache._tags import invalidate_tags
from tests.explorer.history import History, Read, Write
from tests.explorer.scheduler import JOINED, PROBE, REFRESHING, Probe, Scheduler
from tests.helpers import make_config, start_relay

__all__ = ["VARIANTS", "World", "run_schedule"]

BREAKER_RESET = 0.02

# name -> namespace settings of `book` (key template fixed: book:{id})
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    # "2/s": a key is hot from its second read in a window (one read is 1/s: a threshold at
    # or below it is refused at load).
    "hot": {"hot": {"replicas": 4, "threshold": "2/s", "window": "1s", "cooldown": "30s"}},
    "stale": {
        "l1": {"ttl": "8ms"},  # L1 never outlives the soft expiry anyway; this says so
        "l2": {"ttl": "8ms", "jitter": 0.0},
        "stale": {"max_age": "30s"},
        "stampede": {
            "lease_ttl": "1s",
            "reread_pause": ["2ms", "10ms"],
            "max_wait": "300ms",
            "early_refresh_beta": 4.0,
            "load_timeout": "3ms",
        },
    },
    "no_l1": {"l1": False},
    # Every read-through and set() passes tags (key i: its own tag and one shared by
    # every key of the schedule); invalidate_tag and the daemon's tag route write.
    "tags": {"tags": True},
    # Defaults, but both instances read the backplane through a relay (``_relay``) that
    # runs under the probe too: its reads of Redis yield and fail like the instances'.
    "relay": {},
}
RELAYED = {"relay"}
_STAMPEDE = {"lease_ttl": "1s", "reread_pause": ["2ms", "10ms"], "max_wait": "300ms"}

_KINDS = [
    ("get_or_load", 28),
    ("get", 8),
    ("get_or_load_many", 10),
    ("get_many", 4),
    ("invalidate", 16),
    ("set", 14),
    ("daemon", 12),
    ("cancel", 8),
    ("outage", 4),
]
# Only where the namespace has tags = true (the `tags` variant).
_TAG_KINDS = [("invalidate_tag", 16)]
_READS = ("get_or_load", "get", "get_or_load_many", "get_many")
_BATCHES = ("get_or_load_many", "get_many")


def variant_config(
    url: str, prefix: str, variant: str, cluster: bool = False, relay: str = ""
) -> Config:
    namespace: dict[str, Any] = {"key": "book:{id}", "stampede": dict(_STAMPEDE)}
    namespace.update(VARIANTS[variant])
    return make_config(
        url,
        prefix,
        {"book": namespace},
        redis={
            "cluster": cluster,
            "timeout": "500ms",
            "breaker": {"failures": 3, "reset": f"{int(BREAKER_RESET * 1000)}ms"},
        },
        backplane={"block": "50ms", "relay": relay},
    )


def in_early_refresh() -> bool:
    """Whether this load runs for the library's XFetch refresh (``REFRESHING``, set by
    the patched ``Refresher._refresh`` while ``yield_points`` is in force)."""
    return REFRESHING.get()


@dataclass
class World:
    """Long-lived per variant: instances are reused across schedules (keys differ)."""

    variant: str
    config: Config
    probe: Probe
    instances: dict[str, LayeredCache] = field(default_factory=dict)
    daemon: Invalidator | None = None
    daemon_store: L2Store | None = None
    _daemon_client: Any = None
    relay: Relay | None = None
    # Redis may evict (a full Redis under an eviction policy): L2 may lose what L1 holds.
    l2_may_lose: bool = False

    @classmethod
    async def start(cls, url: str, prefix: str, variant: str, cluster: bool = False) -> World:
        config = variant_config(url, f"{prefix}{variant}:", variant, cluster)
        world = cls(variant, config, Probe())
        # Start everything under the probe: background tasks (backplane listeners,
        # fills, refreshes) inherit the context, so their awaits are yield points too.
        token = PROBE.set(world.probe)
        try:
            if variant in RELAYED:
                world.relay, relay_url = await start_relay(config)
                world.config = config = variant_config(
                    url, f"{prefix}{variant}:", variant, cluster, relay_url
                )
            for name in ("A", "B"):
                cache = LayeredCache.from_config(config)
                await cache.start()
                world.instances[name] = cache
            world._daemon_client = make_client(config.redis)
            breaker = CircuitBreaker(3, BREAKER_RESET)
            stream = config.redis.prefix + config.backplane.stream
            publisher = BackplanePublisher(world._daemon_client, stream, config.backplane.maxlen)
            world.daemon_store = L2Store(world._daemon_client, breaker)
            world.daemon = Invalidator(world.daemon_store, publisher)
        finally:
            PROBE.reset(token)
        for cache in world.instances.values():
            assert cache._backplane is not None
            await asyncio.wait_for(cache._backplane.connected.wait(), 10)
        return world

    async def close(self) -> None:
        for cache in self.instances.values():
            await cache.close()
        if self._daemon_client is not None:
            await self._daemon_client.aclose()
        if self.relay is not None:
            await self.relay.close()

    def name_of(self, cache: LayeredCache) -> str:
        return next(name for name, other in self.instances.items() if other is cache)


@dataclass
class Op:
    index: int
    kind: str
    instance: str
    key_id: int
    stagger: int
    target: int = -1  # cancel: index of the op to cancel
    batch: list[int] = field(default_factory=list)  # batches: the keys read, in order
    tag: str | None = None  # invalidate_tag, daemon: "own" (the key's tag) or "shared"


@dataclass
class Outcome:
    seed: int
    variant: str
    violations: list[str]
    points: int
    faults: int
    trace: list[str]


def make_program(rng: random.Random, keys: int, tagged: bool = False) -> list[Op]:
    table = _KINDS + (_TAG_KINDS if tagged else [])
    kinds = [k for k, _ in table]
    weights = [w for _, w in table]
    count = rng.randint(5, 12)
    program = []
    for index in range(count):
        kind = rng.choices(kinds, weights)[0]
        op = Op(index, kind, rng.choice("AB"), rng.randrange(keys), rng.randrange(40))
        if kind == "cancel":
            op.target = rng.randrange(count)
        elif kind in _BATCHES:
            # 2-3 keys; with fewer keys in the schedule, one repeats (a legal call).
            op.batch = [rng.randrange(keys) for _ in range(rng.randint(2, 3))]
        elif kind == "invalidate_tag" or (kind == "daemon" and tagged and rng.random() < 0.5):
            # The key's own tag, or the tag every key of the schedule carries.
            op.tag = "shared" if rng.random() < 0.35 else "own"
        program.append(op)
    return program


class _Run:
    """One schedule: the database, the history and the operations' bodies."""

    def __init__(self, world: World, seed: int, keys: int) -> None:
        self.world = world
        self.seed = seed
        self.rng = random.Random(seed ^ 0x5EED)
        self.history = History()
        if world.variant == "no_l1":
            self.history.instances_without_l1 = set(world.instances)
        self.tagged = world.variant == "tags"
        self.keys = [{"id": f"s{seed}k{i}"} for i in range(keys)]
        self.db = {self.key(i): 0 for i in range(keys)}
        self.index_of = {self.key(i): i for i in range(keys)}
        for name in self.db:
            self.history.writes[(name, 0)] = Write(0, "initial", name, None, 0, 0, True)
        self.fail_loads = self.rng.random() < 0.5
        # The writes a task is running (an invalidate_tag writes every key of its tag),
        # in a context variable rather than keyed by task: the library finishes an
        # invalidation in a task of its own (``BackgroundTasks.to_completion``), which
        # inherits the context, so its XADD is still the write's.
        self.current_write: contextvars.ContextVar[tuple[Write, ...]] = contextvars.ContextVar(
            "current_write", default=()
        )

    def key(self, index: int) -> str:
        return self.world.instances["A"].key("book", self.keys[index])

    # -- tags (the `tags` variant) -------------------------------------------------------

    @property
    def shared_tag(self) -> str:
        return f"s{self.seed}:all"

    def tags_of(self, index: int) -> list[str]:
        """Key ``index``'s tags: its own, and the one every key of the schedule carries."""
        return [f"s{self.seed}:t{index}", self.shared_tag]

    def tags_of_value(self, value: Any) -> list[str]:
        return self.tags_of(self.index_of[value["key"]])

    def tag_of(self, op: Op) -> tuple[str, list[int]]:
        """The tag ``op`` invalidates and the keys carrying it."""
        if op.tag == "shared":
            return self.shared_tag, list(range(len(self.keys)))
        return self.tags_of(op.key_id)[0], [op.key_id]

    def tags_arg(self, index: int, batch: bool) -> Any:
        """What a read-through passes as ``tags=``: a list, or a function of the loaded
        value (a batch's values have different tags: always the function)."""
        if not self.tagged:
            return None
        scheduler = self.world.probe.scheduler
        assert scheduler is not None
        if batch or scheduler.rng.random() < 0.5:
            return self.tags_of_value
        return self.tags_of(index)

    # -- loaders -------------------------------------------------------------------------

    def loader(
        self, name: str, who: str, state: list[str] | None = None, *, quick: bool = False
    ) -> Callable[[], Awaitable[Any]]:
        """``state`` (if given) records the load's progress: a read whose own load
        failed or was still running when it returned got a fallback (stale) value.
        ``quick``: no query time (the final reads, where it races nothing)."""
        load_many = self.load_many(who, {name: state} if state is not None else {}, quick=quick)
        fields = self.keys[self.index_of[name]]

        async def load() -> Any:
            return (await load_many([fields]))[0]

        return load

    def load_many(
        self, who: str, states: dict[str, list[str]], *, quick: bool = False
    ) -> Callable[[list[Any]], Awaitable[list[Any]]]:
        """A database query for several keys: it reads every version at its start (its
        linearisation point). ``states``: each key's load progress (see ``loader``)."""
        scheduler = self.world.probe.scheduler
        assert scheduler is not None
        cache = self.world.instances["A"]

        async def load(fields_list: list[Any]) -> list[Any]:
            names = [cache.key("book", fields) for fields in fields_list]
            # An XFetch early refresh calls the read's loader from a background task after
            # the read was answered from L2: that load is not the read's own, and still
            # running when the read returns must not make the L2 value look like a
            # fallback (a batch once "returned a fallback" superseded mid-way that way).
            own = not in_early_refresh()
            progress = [states.setdefault(name, []) for name in names] if own else []
            for state in progress:
                state.append("running")
            await scheduler.point()
            versions = [self.db[name] for name in names]
            read = ", ".join(f"{n}=v{v}" for n, v in zip(names, versions, strict=True))
            self.history.tick(f"{who} loader read {read}")
            # The query takes a while, sometimes long enough for whole invalidations to
            # run (and reach the other instance) meanwhile.
            if not quick:
                await asyncio.sleep(scheduler.rng.choice((0.0, 0.001, 0.005, 0.015, 0.015)))
            await scheduler.point()
            if self.fail_loads and scheduler.rng.random() < 0.3:
                self.history.tick(f"{who} loader failed")
                for state in progress:
                    state.append("failed")
                raise RuntimeError("explorer: database error")
            for state in progress:
                state.append("ok")
            # A tuple inside: L2 can only hand it back as a list, so a read that returns a
            # tuple got the loader's own object (fix 11: every layer returns one type).
            return [
                {"key": n, "v": v, "shape": (v, n)} for n, v in zip(names, versions, strict=True)
            ]

        return load

    # -- operations ----------------------------------------------------------------------

    async def run_op(self, op: Op, tasks: list[asyncio.Task[Any]]) -> None:
        scheduler = self.world.probe.scheduler
        assert scheduler is not None
        if op.stagger < 20:
            for _ in range(op.stagger):
                await asyncio.sleep(0)
        else:  # a later arrival: after other operations may have finished
            await asyncio.sleep((op.stagger - 20) / 1000)
        cache = self.world.instances[op.instance]
        who = f"#{op.index} {op.kind}@{op.instance}"
        if op.kind == "outage":
            scheduler.outage = scheduler.rng.randint(3, 25)
            self.history.tick(f"{who}: the next {scheduler.outage} commands fail")
            return
        if op.kind == "cancel":
            target = tasks[op.target]
            if not target.done():
                self.history.tick(f"{who} cancels #{op.target}")
                target.cancel()
            return
        if op.kind in _READS:
            await self.read(op, cache, who)
            return
        await self.write(op, cache, who)

    async def read(self, op: Op, cache: LayeredCache, who: str) -> None:
        """A read of one key, or a batch of 2-3: each value returned is one read of the
        history, all with the operation's begin and end."""
        scheduler = self.world.probe.scheduler
        assert scheduler is not None
        batch = op.kind in _BATCHES
        indices = op.batch if batch else [op.key_id]
        names = [self.key(i) for i in indices]
        began = self.history.tick(f"{who} {' '.join(names)} begins")
        states: dict[str, list[str]] = {}
        fields_list = [self.keys[i] for i in indices]
        tags = self.tags_arg(op.key_id, batch)
        joined: set[str] = set()
        joined_token = JOINED.set(joined)
        read: Awaitable[Any]
        if op.kind == "get":
            read = cache.get("book", fields_list[0])
        elif op.kind == "get_or_load":
            state = states.setdefault(names[0], [])
            read = cache.get_or_load(
                "book", fields_list[0], self.loader(names[0], who, state), tags
            )
        elif op.kind == "get_many":
            read = cache.get_many("book", fields_list)
        else:
            read = cache.get_or_load_many("book", fields_list, self.load_many(who, states), tags)
        try:
            if scheduler.rng.random() < 0.25:
                # A client timeout: the request is cancelled wherever it is.
                result = await asyncio.wait_for(read, scheduler.rng.uniform(0.001, 0.02))
            else:
                result = await read
        finally:
            JOINED.reset(joined_token)
        values = list(result) if batch else [result]
        if len(values) != len(names):
            self.history.type_errors.append(f"{who} got {len(values)} values for {len(names)} keys")
            return
        returned = []
        seen: dict[str, Any] = {}
        for name, value in zip(names, values, strict=True):
            if name in seen:  # a key a batch names twice: one read, the same value twice
                if value != seen[name]:
                    self.history.type_errors.append(
                        f"{who} got {value} and {seen[name]} for {name}, named twice"
                    )
                continue
            seen[name] = value
            version = None if value is None else int(value["v"])
            if value is not None and value.get("key") != name:
                self.history.type_errors.append(f"{who} got {value['key']}'s value for {name}")
            if value is not None and "shape" in value and not isinstance(value["shape"], list):
                self.history.type_errors.append(
                    f"{who} got {type(value['shape']).__name__} where L2 returns list: "
                    "the type depends on the layer that answered"
                )
            state = states.get(name, [])
            fallback = bool(state) and state[-1] != "ok"
            returned.append((name, version, fallback))
        ended = self.history.tick(
            f"{who} returned "
            + ", ".join(
                f"v{version}{' (fallback: its load failed or is running)' if fallback else ''}"
                for _, version, fallback in returned
            )
        )
        for name, version, fallback in returned:
            self.history.reads.append(
                Read(op.kind, name, op.instance, began, ended, version, fallback, name in joined)
            )

    async def write(self, op: Op, cache: LayeredCache, who: str) -> None:
        tag, indices = self.tag_of(op) if op.tag is not None else (None, [op.key_id])
        kind = f"{op.kind}-tag" if op.kind == "daemon" and tag is not None else op.kind
        instance = None if op.kind == "daemon" else op.instance
        writes = []
        for index in indices:
            name = self.key(index)
            self.db[name] += 1
            writes.append(Write(self.db[name], kind, name, instance, 0))
        what = f"tag {tag} " if tag is not None else ""
        began = self.history.tick(
            f"{who} {what}" + ", ".join(f"{w.key} db=v{w.version}" for w in writes)
        )
        for write in writes:
            write.began = began
            self.history.writes[(write.key, write.version)] = write
        writing = self.current_write.set(tuple(writes))
        ok = False
        try:
            fields = self.keys[op.key_id]
            if op.kind == "invalidate":
                await cache.invalidate("book", fields)
            elif op.kind == "set":
                value = {"key": writes[0].key, "v": writes[0].version}
                tags = self.tags_of(op.key_id) if self.tagged else None
                await cache.set("book", fields, value, tags)
            elif op.kind == "invalidate_tag":
                assert tag is not None
                await cache.invalidate_tag(tag)
            else:
                await self.daemon(cache, writes[0].key, tag)
            ok = True
        finally:
            ended = self.history.tick(f"{who} {'ok' if ok else 'failed'}")
            for write in writes:
                write.ok, write.ended = ok, ended
            self.current_write.reset(writing)

    async def daemon(self, cache: LayeredCache, name: str, tag: str | None) -> None:
        """What the daemon runs for one event: the key's deletes, or (a route
        ``{ tag = ... }``) new tag versions; then the backplane entry."""
        daemon, store = self.world.daemon, self.world.daemon_store
        assert daemon is not None and store is not None
        try:
            if tag is None:
                await daemon.invalidate([(name, cache.namespace("book").policy.replicas)])
            else:
                prefix = self.world.config.redis.prefix
                await daemon.announce_tags(await invalidate_tags(store, prefix, [tag]))
        except REDIS_FAILURES as exc:
            # The daemon retries the batch and commits only after it succeeds;
            # this attempt failed and committed nothing.
            raise L2Unavailable(str(exc)) from exc

    def on_reply(self, command: str, args: tuple[Any, ...], result: Any) -> None:
        """Backplane bookkeeping: a write's entry id, and how far each listener read."""
        task = asyncio.current_task()
        if command == "XADD":
            writes = self.current_write.get()
            if result:
                for write in writes:
                    write.entry_id = parse_id(result)
        elif command == "XREAD" and result and task is not None:
            instance = self._listener_instance(task)
            if instance is not None:
                # The raw reply on a single node (a map in RESP3, an array from a relay),
                # redis-py's parsed one in a cluster: an entry's ID comes first in each.
                streams = result.values() if isinstance(result, dict) else [e for _, e in result]
                for entries in streams:
                    if entries:
                        self.history.delivered(instance, parse_id(entries[-1][0]))

    def _listener_instance(self, task: asyncio.Task[Any]) -> str | None:
        for name, cache in self.world.instances.items():
            backplane = cache._backplane
            if backplane is not None and backplane._task is task:
                return name
        return None


async def run_schedule(world: World, seed: int, *, keys: int = 1) -> Outcome:
    rng = random.Random(seed)
    fault_rate = rng.choice([0.0, 0.0, 0.0, 0.02, 0.06])
    scheduler = Scheduler(seed, fault_rate=fault_rate)
    run = _Run(world, seed, keys)
    probe = world.probe
    probe.scheduler = scheduler
    probe.on_reply = run.on_reply
    probe.trace = run.history.tick
    token = PROBE.set(probe)
    program = make_program(rng, keys, run.tagged)
    violations: list[str] = []
    try:
        tasks: list[asyncio.Task[Any]] = []
        for op in program:
            tasks.append(asyncio.ensure_future(_guarded(run, op, tasks)))
        done, pending = await asyncio.wait(tasks, timeout=20)
        if pending:
            violations.append(f"{len(pending)} operations still running after 20 s (hung)")
            for task in pending:
                task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                error = task.exception()
                violations.append(f"an operation raised {type(error).__name__}: {error}")
        violations += run.history.violations() + run.history.type_errors
        # Quiet phase: no faults; the layers agree, every instance recovers and converges.
        scheduler.fault_rate = 0.0
        scheduler.outage = 0
        violations += await _coherent(run)
        violations += await _converges(run)
    finally:
        PROBE.reset(token)
        probe.scheduler = None
        probe.on_reply = None
        probe.trace = None
    return Outcome(
        seed, world.variant, violations, scheduler.points, scheduler.faults, run.history.events
    )


async def _guarded(run: _Run, op: Op, tasks: list[asyncio.Task[Any]]) -> None:
    """Expected failures are outcomes, not test errors: Redis unavailable for a write,
    a loader error with no stale value, a cancellation."""
    with contextlib.suppress(
        L2Unavailable, RuntimeError, asyncio.CancelledError, asyncio.TimeoutError
    ):
        await run.run_op(op, tasks)


async def _coherent(run: _Run, settle: float = 0.3) -> list[str]:
    """Once every backplane entry has reached every instance and background work has had
    time to finish: each replica holds the base key's value or nothing, and each
    instance's ``get()`` answers the base key's value or nothing. (Which of two
    concurrent writers' values L2 keeps is not checked: their order is undefined.)
    Incoherence is a state, so it is reported only if it lasts ``settle`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle
    while True:
        problems = await _incoherence(run)
        if not problems or loop.time() > deadline:
            return problems
        await asyncio.sleep(0.02)


async def _incoherence(run: _Run) -> list[str]:
    world = run.world
    any_cache = world.instances["A"]
    client = any_cache._store.client
    stream = world.config.redis.prefix + world.config.backplane.stream
    newest = await client.xrevrange(stream, count=1)
    if newest:
        tail = parse_id(newest[0][0])
        for instance in world.instances:
            await _delivered(run, instance, tail)
    policy = any_cache.namespace("book").policy

    async def version(name: str) -> int | None:
        data = await client.get(name)
        if data is None:
            return None
        envelope = policy.codec.decode(data)
        if envelope.tags and not await _tags_current(client, run, envelope.tags):
            return None  # a tag of it was invalidated since: dead, as good as absent
        return int(envelope.value["v"])

    problems = []
    for index in range(len(run.keys)):
        name = run.key(index)
        writes = [w for w in run.history.writes.values() if w.key == name]
        if world.config.redis.cluster and _overlapping_sets(writes):
            # A cluster can't write a key and its replicas (other slots) atomically:
            # concurrent set() calls may leave them disagreeing until their TTL
            # (docs/hotkeys.md; issue 21 "writers that agree").
            continue
        if any(_unannounced(w) for w in writes):
            # A write that failed or was cancelled may have landed in L2 without being
            # announced, and set() returns even when its XADD failed (Redis was what
            # failed): other instances learn nothing, and the L1 TTL is the bound
            # (issue 18 is about delivering it another way). The read rule still
            # applies to every read.
            continue
        base = await version(name)
        if base is None and world.l2_may_lose:
            # Redis evicts (allkeys-*, volatile-*): a key, or a tag version that kills
            # its entries, can vanish from L2 while L1 copies of the same, current
            # value live on (nothing was written: no instance is told). Not stale, and
            # the read rule still judges every read.
            continue
        for replica in replica_names(name, policy.replicas):
            held = await version(replica)
            if held is not None and held != base:
                problems.append(f"replica {replica} holds v{held} while {name} holds v{base}")
        # L2 empty: a load that L2 could not take (Redis failed or refused the fill) is
        # kept in its instance's L1; it must be the database's current value.
        expected = run.db[name] if base is None else base
        for instance, cache in world.instances.items():
            value = await cache.get("book", run.keys[index])
            if value is not None and int(value["v"]) != expected:
                problems.append(
                    f"{instance} serves v{value['v']} of {name}; L2 holds v{base}, "
                    f"the database v{run.db[name]}"
                )
    return problems


async def _tags_current(client: Any, run: _Run, tags: dict[str, str]) -> bool:
    """Whether every tag version an envelope carries is still the tag's current one
    (``{prefix}layered_cache:tag:<tag>``; a missing version key kills the entry too)."""
    prefix = run.world.config.redis.prefix
    for tag, version in tags.items():
        current = await client.get(tag_version_name(prefix, tag))
        if current is None or current.decode() != version:
            return False
    return True


def _overlapping_sets(writes: list[Write]) -> bool:
    sets = [w for w in writes if w.kind == "set"]
    return any(
        a is not b and a.began < (b.ended or 1 << 62) and b.began < (a.ended or 1 << 62)
        for a in sets
        for b in sets
    )


def _unannounced(write: Write) -> bool:
    return write.kind != "initial" and (not write.ok or write.entry_id is None)


async def _converges(run: _Run) -> list[str]:
    """A final invalidate (on A or B, by seed) of each key must succeed once the breaker's
    reset has passed, and then every instance must read the final version."""
    world = run.world
    run.fail_loads = False
    problems = []
    names = list(world.instances)
    for index in range(len(run.keys)):
        name = run.key(index)
        fields = run.keys[index]
        instance = names[(run.seed + index) % len(names)]
        cache = world.instances[instance]
        final = run.db[name] + 1
        run.db[name] = final
        # In the tags variant, every other key's final write is an invalidate_tag of its
        # own tag: a tag invalidation must recover from faults and reach everyone too.
        by_tag = run.tagged and (run.seed + index) % 2 == 1
        kind = "final-invalidate_tag" if by_tag else "final-invalidate"
        write = Write(final, kind, name, instance, run.history.tick())
        run.history.writes[(name, final)] = write
        writing = run.current_write.set((write,))
        tag = run.tags_of(index)[0] if by_tag else None
        ok = await _retry_until(
            lambda c=cache, f=fields, t=tag: (
                c.invalidate_tag(t) if t is not None else c.invalidate("book", f)
            ),
            3.0,
        )
        run.current_write.reset(writing)
        if not ok:
            problems.append(f"{kind}@{instance} of {name} still failing 3 s after faults")
            continue
        write.ok, write.ended = True, run.history.tick(f"{kind}@{instance} ok")
        tags = run.tags_of(index) if run.tagged else None
        for reader_name, reader in world.instances.items():
            if reader_name != instance and write.entry_id is not None:
                await _delivered(run, reader_name, write.entry_id)
            value = await reader.get_or_load(
                "book", fields, run.loader(name, f"final read@{reader_name}", quick=True), tags
            )
            if int(value["v"]) != final:
                problems.append(
                    f"after the {kind}@{instance} of {name}, "
                    f"{reader_name} read v{value['v']}, not v{final}"
                )
    return problems


async def _retry_until(attempt: Callable[[], Awaitable[None]], limit: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        try:
            await attempt()
            return True
        except L2Unavailable:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(BREAKER_RESET / 2)


async def _delivered(run: _Run, instance: str, entry_id: tuple[int, int]) -> None:
    """Wait until ``instance``'s backplane listener has read up to ``entry_id``."""
    backplane = run.world.instances[instance]._backplane
    assert backplane is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while loop.time() < deadline:
        if backplane.last_id is not None and parse_id(backplane.last_id) >= entry_id:
            return
        await asyncio.sleep(0.002)
