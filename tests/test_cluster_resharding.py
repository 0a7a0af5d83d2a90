"""A Redis Cluster resharding under the cache: a slot in migration (its keys split between
two masters, ASK and TRYAGAIN replies), a master added to the cluster, and what the cache
does meanwhile. The migration steps are driven by hand at chosen points (CLUSTER SETSLOT
IMPORTING/MIGRATING, MIGRATE), as `redis-cli --cluster reshard` takes them for every slot
it moves; each test starts a cluster of its own. Found by a review; each failed before
its fix."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest
import redis as syncredis
from redis.crc import key_slot

from layered_cache import Config, LayeredCache
from layered_cache._keys import tag_version_name
from layered_cache._l2 import L2Unavailable
from tests.helpers import CountingLoader, make_config
from tests.servers import RedisClusterServers, RedisServer, free_port

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.timeout(120)]

HOST = "127.0.0.1"


# -- a cluster of the test's own, and the reshard steps by hand ---------------------------


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(3) as servers:
        yield servers


@pytest.fixture
def prefix() -> str:
    return f"r{uuid.uuid4().hex[:8]}:"


def node(port: int) -> syncredis.Redis:
    return syncredis.Redis(host=HOST, port=port, socket_timeout=5)


def node_id(port: int) -> str:
    return node(port).execute_command("CLUSTER MYID").decode()


def slot_owners(port: int) -> dict[int, int]:
    """slot -> port of its master, from CLUSTER SLOTS."""
    owners: dict[int, int] = {}
    for lo, hi, master, *_ in node(port).execute_command("CLUSTER SLOTS"):
        for slot in range(lo, hi + 1):
            owners[slot] = int(master[1])
    return owners


def begin_migration(slot: int, source: int, target: int) -> None:
    """What redis-cli does first for each slot it moves."""
    node(target).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", node_id(source))
    node(source).execute_command("CLUSTER SETSLOT", slot, "MIGRATING", node_id(target))


def finish_migration(slot: int, target: int, ports: list[int]) -> None:
    """What redis-cli does last for each slot it moved: every master learns the owner."""
    for port in ports:
        node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", node_id(target))


def migrate_keys(slot: int, source: int, target: int) -> list[bytes]:
    """Move every key of ``slot`` (redis-cli: GETKEYSINSLOT + MIGRATE, 10 at a time)."""
    keys = node(source).execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
    if keys:
        node(source).execute_command("MIGRATE", HOST, target, "", 0, 5000, "KEYS", *keys)
    return list(keys)


def key_ids_on(owners: dict[int, int], prefix: str, port: int, n: int, skip: set[int]) -> list[int]:
    """``n`` ids whose ``book:{id}`` lives on master ``port``, in slots not in ``skip``."""
    found = []
    for i in range(10, 100_000):
        slot = key_slot(f"{prefix}book:{i}".encode())
        if owners[slot] == port and slot not in skip:
            found.append(i)
            skip = skip | {slot}
            if len(found) == n:
                return found
    raise AssertionError("no such key")


def config(cluster: RedisClusterServers, prefix: str) -> Config:
    # L1 off: every read reaches L2, so what L2 does is what the caller sees. The
    # library's default breaker (3 failures in a row), a reset long enough to observe.
    namespaces = {"book": {"key": "book:{id}", "l1": False}}
    return make_config(
        cluster.url,
        prefix,
        namespaces,
        redis={"cluster": True, "timeout": "1s", "breaker": {"failures": 3, "reset": "10s"}},
    )


async def warm_connections(cache: LayeredCache, ids: list[int]) -> None:
    """A serving process holds several idle connections to each master (concurrent
    requests opened them): make this one hold them too."""
    await asyncio.gather(*(cache.get("book", {"id": i}) for i in ids))


# -- finding 1: ASK redirects are not followed ---------------------------------------------


async def test_a_slot_in_migration_opens_no_breaker_and_the_masters_other_keys_stay_in_l2(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """Mid-reshard, a key already MIGRATEd answers ASK at its source. redis-py's asyncio
    client sends the ASKING on another pooled connection than the GET (the target then
    sends it back: "TTL exhausted"), so the key's reads go to the loader while its slot
    moves. That was counted against the source master's breaker: three reads opened it,
    and every key of that master, in slots nobody moves, went to the database too. A slot
    in migration is now about its own keys: no breaker opens."""
    first = cluster.nodes[0][1]
    owners = slot_owners(first)
    async with LayeredCache.from_config(config(cluster, prefix)) as cache:
        src = owners[key_slot(f"{prefix}book:1".encode())]
        dst = next(port for _, port in cluster.nodes if port != src)
        moved_slot = key_slot(f"{prefix}book:1".encode())
        (other,) = key_ids_on(owners, prefix, src, 1, {moved_slot})
        on_dst = key_ids_on(owners, prefix, dst, 16, set())

        await cache.get_or_load("book", {"id": 1}, CountingLoader("moved-key v1"))
        await cache.get_or_load("book", {"id": other}, CountingLoader("other v1"))
        await warm_connections(cache, on_dst)

        begin_migration(moved_slot, src, dst)
        assert migrate_keys(moved_slot, src, dst), "the key is on the target now"

        moved_loader = CountingLoader("moved-key v1")
        for _ in range(5):  # requests for the key while its slot moves
            assert await cache.get_or_load("book", {"id": 1}, moved_loader) == "moved-key v1"
        other_loader = CountingLoader("other RELOADED")
        other_value = await cache.get_or_load("book", {"id": other}, other_loader)

        status = cache.redis_status()
        assert (other_loader.calls, other_value) == (0, "other v1"), status
        assert all(state == "closed" for state in status.node_breakers.values()), status


# -- finding 2: an ASK to a master added since the slot map was read crashes ---------------


async def test_a_key_migrated_to_a_newly_added_master_is_read_from_l2(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """docs/operations.md, "Redis Cluster": "point `redis.url` at any node; the client
    discovers the rest and follows MOVED/ASK." README, Reliability: "Redis trouble
    degrades, never fails. [...] In a cluster each master has its own breaker, so one
    dead master doesn't send the healthy masters' keys to the database."

    Scaling out: `redis-cli --cluster add-node` joins a new, empty master, then
    `reshard` moves slots to it. While its first slot is moving, the new master owns no
    slot, so no slot map (CLUSTER SLOTS) lists it and no refresh can teach it to the
    client. An ASK to it makes redis-py's ``get_node`` return None and the redirect
    raises AttributeError ("'NoneType' object has no attribute 'execute_command'");
    the store counts it as a failure of the *source* master, whose breaker opens after
    three reads: that master's other keys go to the database.
    """
    first = cluster.nodes[0][1]
    bus = free_port()  # not port + 10000: that may be taken
    spare = RedisServer(
        extra_args=[
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000", "--cluster-port", str(bus),
        ]
    ).start()
    try:
        node(first).execute_command("CLUSTER MEET", HOST, spare.port, bus)  # = add-node
        ports = [port for _, port in cluster.nodes] + [spare.port]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            infos = [node(port).cluster("info") for port in ports]
            if all(
                int(i["cluster_known_nodes"]) == 4 and i["cluster_state"] == "ok" for i in infos
            ):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the new master did not join")
        owners = slot_owners(first)

        async with LayeredCache.from_config(config(cluster, prefix)) as cache:
            moved_slot = key_slot(f"{prefix}book:1".encode())
            src = owners[moved_slot]
            (other,) = key_ids_on(owners, prefix, src, 1, {moved_slot})
            await cache.get_or_load("book", {"id": 1}, CountingLoader("moved-key v1"))
            await cache.get_or_load("book", {"id": other}, CountingLoader("other v1"))

            begin_migration(moved_slot, src, spare.port)
            assert migrate_keys(moved_slot, src, spare.port)

            moved_loader = CountingLoader("moved-key RELOADED")
            for _ in range(3):
                value = await cache.get_or_load("book", {"id": 1}, moved_loader)
            other_loader = CountingLoader("other RELOADED")
            other_value = await cache.get_or_load("book", {"id": other}, other_loader)

            status = cache.redis_status()
            assert (moved_loader.calls, value) == (0, "moved-key v1"), (
                f"the key moved to the new master went to the loader {moved_loader.calls}x; "
                f"{status}"
            )
            assert (other_loader.calls, other_value) == (0, "other v1"), status
    finally:
        spare.close()


# -- finding 3: (key, lease) multi-key commands get TRYAGAIN for a whole migration ---------


async def test_a_slot_in_migration_fails_only_its_own_invalidations_and_opens_no_breaker(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """A slot is MIGRATING, its key still on the source. invalidate() sent `DEL key
    {key}:lease` as one command, and Redis refuses a command on names of a migrating
    slot when some are missing (TRYAGAIN): the lease nearly always is. Each failure
    counted on the shared breaker, so three opened it and invalidate() of a key on
    another master, in a slot nobody moves, raised "circuit breaker open" too.

    Now the names go one DEL each, the lease first: the key is deleted at once. The
    lease's DEL is sent on by its source (ASK) and redis-py's asyncio client loses the
    ASKING on the way ("TTL exhausted"), so the call still raises while the slot moves:
    the daemon retries. It opens no breaker, and once the slot has moved it succeeds."""
    first = cluster.nodes[0][1]
    owners = slot_owners(first)
    async with LayeredCache.from_config(config(cluster, prefix)) as cache:
        slot = key_slot(f"{prefix}book:1".encode())
        src = owners[slot]
        dst = next(port for _, port in cluster.nodes if port != src)
        elsewhere = next(port for _, port in cluster.nodes if port not in (src, dst))
        (other,) = key_ids_on(owners, prefix, elsewhere, 1, {slot})
        await cache.get_or_load("book", {"id": 1}, CountingLoader("v1"))
        await cache.get_or_load("book", {"id": other}, CountingLoader("o1"))

        begin_migration(slot, src, dst)  # nothing moved: the key is on the source
        for _ in range(3):  # the daemon retrying its batch
            with contextlib.suppress(L2Unavailable):
                await cache.invalidate("book", {"id": 1})
        # The key itself is gone from its node (an EXISTS would be answered by ASK).
        left = node(src).execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
        assert f"{prefix}book:1".encode() not in left
        await cache.invalidate("book", {"id": other})  # another master: untouched
        status = cache.redis_status()
        assert status.breaker == "closed", status
        assert all(state == "closed" for state in status.node_breakers.values()), status

        finish_migration(slot, dst, [port for _, port in cluster.nodes])
        await cache.invalidate("book", {"id": 1})  # the slot has moved: it succeeds


# -- a later review: batches, a failed set_many and tag versions while a slot moves --------


async def test_a_batch_with_one_key_of_a_moving_slot_still_serves_its_masters_other_keys_from_l2(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """A batch of 9 keys of one master, one in a slot being migrated (already MIGRATEd:
    its source answers ASK). Each master's part was one mget_nonatomic (and one pipeline
    of leases, of fills) failing whole for that one slot: the 8 keys in slots nobody
    moves were misses for get_many and loaded again by get_or_load_many. Now only the
    moving slot's commands fail."""
    owners = slot_owners(cluster.nodes[0][1])
    async with LayeredCache.from_config(config(cluster, prefix)) as cache:
        moved_slot = key_slot(f"{prefix}book:1".encode())
        src = owners[moved_slot]
        dst = next(port for _, port in cluster.nodes if port != src)
        others = key_ids_on(owners, prefix, src, 8, {moved_slot})
        ids = [1, *others]
        for i in ids:
            await cache.get_or_load("book", {"id": i}, CountingLoader(f"v{i}"))
        await warm_connections(cache, key_ids_on(owners, prefix, dst, 16, set()))
        begin_migration(moved_slot, src, dst)
        assert migrate_keys(moved_slot, src, dst), "the key is on the target now"
        loaded: list[int] = []

        async def load_many(missing: list[dict[str, object]]) -> list[str]:
            loaded.extend(int(str(f["id"])) for f in missing)
            return [f"reloaded {f['id']}" for f in missing]

        fields = [{"id": i} for i in ids]
        got = await cache.get_many("book", fields)
        values = await cache.get_or_load_many("book", fields, load_many)
        status = cache.redis_status()
    assert got[1:] == [f"v{i}" for i in others], (got, status)
    assert values[1:] == [f"v{i}" for i in others] and set(loaded) <= {1}, (values, loaded)
    assert all(state == "closed" for state in status.node_breakers.values()), status


async def test_a_cluster_set_many_that_raises_after_writing_most_keys_still_tells_the_other_instances(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """One key's slot is mid-migration: set_many raises L2Unavailable for it after its
    pipeline wrote the others. Nothing was announced, and B served the old values of
    the written keys from L1 for its whole L1 TTL while L2 held the new ones."""
    owners = slot_owners(cluster.nodes[0][1])
    namespaces = {"book": {"key": "book:{id}", "l1": {"ttl": "10m"}}}
    redis = {"cluster": True, "timeout": "1s", "breaker": {"failures": 3, "reset": "10s"}}
    with_l1 = make_config(cluster.url, prefix, namespaces, redis=redis)
    moved_slot = key_slot(f"{prefix}book:1".encode())
    src = owners[moved_slot]
    dst = next(port for _, port in cluster.nodes if port != src)
    others = key_ids_on(owners, prefix, src, 2, {moved_slot})
    others += key_ids_on(owners, prefix, dst, 2, {moved_slot})
    ids = [1, *others]
    async with LayeredCache.from_config(with_l1) as a, LayeredCache.from_config(with_l1) as b:
        for i in ids:
            await b.get_or_load("book", {"id": i}, CountingLoader("old"))
        await warm_connections(a, key_ids_on(owners, prefix, dst, 16, set()))
        begin_migration(moved_slot, src, dst)
        assert migrate_keys(moved_slot, src, dst), "book 1 is on the target now"
        with pytest.raises(L2Unavailable):
            await a.set_many("book", [({"id": i}, "new") for i in ids])
        in_l2 = {i: await a.get("book", {"id": i}) for i in others}  # A's L1 was dropped
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            on_b = {i: await b.get("book", {"id": i}) for i in others}
            if on_b == in_l2:
                break
            await asyncio.sleep(0.05)
    assert in_l2 == {i: "new" for i in others}, f"set_many wrote the other keys: {in_l2}"
    assert on_b == in_l2, f"L2 holds {in_l2}, B serves {on_b} from its L1"


async def test_a_tagged_batch_serves_entries_whose_tags_are_in_unmoved_slots_while_one_tag_key_moves(
    cluster: RedisClusterServers, prefix: str
) -> None:
    """Ten pages, page i tagged book:i. A new instance (no tag version held) reads them
    in one get_many while book:0's version key is mid-migration: the versions' fetch was
    one pipeline failing whole, and all ten pages were misses. Now only page 0 is."""
    owners = slot_owners(cluster.nodes[0][1])
    namespaces = {"page": {"key": "page:{id}", "l1": False, "tags": True}}
    redis = {"cluster": True, "timeout": "1s", "breaker": {"failures": 3, "reset": "10s"}}
    tagged = make_config(cluster.url, prefix, namespaces, redis=redis)
    ids = list(range(10))
    async with LayeredCache.from_config(tagged) as a:
        for i in ids:
            await a.set("page", {"id": i}, f"page {i}", tags=[f"book:{i}"])
    moved_slot = key_slot(tag_version_name(prefix, "book:0").encode())
    src = owners[moved_slot]
    dst = next(port for _, port in cluster.nodes if port != src)
    assert all(key_slot(f"{prefix}page:{i}".encode()) != moved_slot for i in ids)
    begin_migration(moved_slot, src, dst)
    assert migrate_keys(moved_slot, src, dst), "book:0's version key moved"
    async with LayeredCache.from_config(tagged) as b:
        # Several idle connections to each master, as a serving process holds (with two
        # or more, redis-py sends an ASK's ASKING on another connection than the command).
        for _ in range(2):
            await asyncio.gather(*(b.get("page", {"id": 1000 + j}) for j in range(96)))
        got = await b.get_many("page", [{"id": i} for i in ids])
        status = b.redis_status()
    assert got[1:] == [f"page {i}" for i in ids[1:]], (got, status)
