"""Lua scripts of the L2 store, and why each must run as one atomic step.

- ``FILL``: "write the value only if my lease token is still the lease" must be one
  step, otherwise an invalidation (which deletes the lease) could slip in between the
  check and the write and the old value would outlive it. The lease name
  ``{key}:lease`` carries ``key`` as its hash tag, so in Redis Cluster both names live in
  one slot and one script may touch them. The same script publishes the envelope so
  waiters in other processes wake up without polling, but only when this node has a
  subscriber on the channel: most fills have no waiter, and a publish nobody reads
  still costs the whole value on the wire. In a cluster it is ``SPUBLISH`` (sharded
  pub/sub): the channel ``{key}:filled`` hashes to the key's slot, so the message
  stays within that slot's master and its replicas instead of the cluster bus
  broadcasting it to every node (``_notify.py``). An envelope larger than
  ``NOTIFY_INLINE_MAX`` is announced by an empty message instead, and the waiter GETs
  it: the value then crosses the wire once per waiting process, not once more per
  node of the shard (``bench/fill_bytes.py`` has the figures).
- ``RELEASE``: compare-and-delete: a slow winner whose lease expired and was taken by
  someone else must not delete the new holder's lease.
- ``WRITE`` (a single node only): ``set()``'s writes - the SETs of a key (and its
  replicas), the DELs of the leases it revokes, and the backplane append - as one
  step. Atomic like the MULTI/EXEC it replaces (two concurrent ``set()`` calls of a hot
  key can't interleave, or the base key could end with one writer's value and the
  replicas with the other's), at the cost of one command instead of five: the redis-py
  transaction parsed a reply per queued command. The SETs come first: Redis checks
  ``maxmemory`` at a script's first write only, so a full ``noeviction`` Redis refuses
  the whole script (nothing written, as an aborted MULTI) rather than letting the
  lease DELs through and refusing the SET. The append runs under ``pcall``: a stream
  that refuses it (a WRONGTYPE name) leaves the SETs in place and the script returns
  the error, so the caller announces another way (``_fallback``), as before.
- ``WRITE_ONE``: the same for the most common write, a ``set()`` of one key that is not
  hot (one SET, its lease's DEL, the append), without ``WRITE``'s loops and counts:
  Redis ran it in ~18 µs against ~24 µs (``INFO commandstats``, bench VM), and it takes
  four arguments fewer to pack and parse.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "FILL_SCRIPT",
    "NOTIFY_INLINE_MAX",
    "READ_UNDER_LEASE_SCRIPT",
    "RELEASE_SCRIPT",
    "WRITE_ONE_SCRIPT",
    "WRITE_SCRIPT",
    "fill_args",
    "write_args",
    "write_script_args",
]

# Fill notifications carry the envelope up to this size (bytes), else they are empty and
# the waiter GETs the value. Below it, a message costs about what its header costs (a
# cluster bus message has a ~2 KB header), and the waiter saves a round trip.
NOTIFY_INLINE_MAX = 2048

FILL_SCRIPT = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[2])
end
if ARGV[4] ~= '' then
  local sharded = ARGV[6] == '1'
  local waiting = redis.call('PUBSUB', sharded and 'SHARDNUMSUB' or 'NUMSUB', ARGV[4])
  if waiting[2] > 0 then
    local body = ARGV[2]
    if string.len(body) > tonumber(ARGV[7]) then
      body = ''
    end
    redis.call(sharded and 'SPUBLISH' or 'PUBLISH', ARGV[4], body)
  end
end
return 1
"""

RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Read the base key and its remaining TTL only while ``token`` still holds the lease, and
# release the lease in the same step. Used to copy a base value to replicas: the check
# proves no invalidation deleted the lease before this instant (see ``fill_replicas``).
READ_UNDER_LEASE_SCRIPT = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return false
end
redis.call('DEL', KEYS[2])
local data = redis.call('GET', KEYS[1])
if not data then
  return false
end
return {data, redis.call('PTTL', KEYS[1])}
"""


def fill_args(
    token: str,
    data: bytes,
    ttl_ms: int,
    channel: str,
    release: bool,
    sharded: bool,
    inline_max: int = NOTIFY_INLINE_MAX,
) -> list[str | bytes | int]:
    """ARGV of FILL_SCRIPT, in its order; single fills and batch fills alike (a missing
    argument would make the script fail whenever a waiter is subscribed)."""
    flags = ["1" if release else "0", "1" if sharded else "0", inline_max]
    return [token, data, ttl_ms, channel, *flags]


# KEYS: every write's names to SET, then every write's names to DEL, then the stream if
# the write is announced. ARGV: the number of writes; per write the number of its SETs,
# of its DELs, its data and its TTL (ms); then, if announced, the stream's MAXLEN and the
# entry's field/value pairs. Returns 1, or the error the stream's XADD replied. The DELs
# go 1,000 names to a call (under Lua's unpack limit): one ``redis.call`` per name was
# ~18 % of Redis's time in a set_many of 100 (``INFO commandstats``, docs/benchmarks.md).
WRITE_SCRIPT = """
local writes = tonumber(ARGV[1])
local k, a = 1, 2
for _ = 1, writes do
  local data, ttl = ARGV[a + 2], ARGV[a + 3]
  for i = k, k + tonumber(ARGV[a]) - 1 do
    redis.call('SET', KEYS[i], data, 'PX', ttl)
  end
  k = k + tonumber(ARGV[a])
  a = a + 4
end
local first = k
a = 2
for _ = 1, writes do
  k = k + tonumber(ARGV[a + 1])
  a = a + 4
end
for i = first, k - 1, 1000 do
  redis.call('DEL', unpack(KEYS, i, math.min(i + 999, k - 1)))
end
if KEYS[k] == nil then
  return 1
end
local reply = redis.pcall('XADD', KEYS[k], 'MAXLEN', '~', ARGV[a], '*', unpack(ARGV, a + 1))
if type(reply) == 'table' and reply.err then
  return reply.err
end
return 1
"""


def write_args(
    writes: Sequence[tuple[Sequence[str], Sequence[str], bytes, int]],
    stream: str | None = None,
    maxlen: int = 0,
    fields: Sequence[bytes | str] = (),
) -> tuple[list[str], list[bytes | str | int]]:
    """(KEYS, ARGV) of ``WRITE_SCRIPT`` for ``(names, delete_first, data, ttl_ms)`` writes
    and, if ``stream`` is given, the entry ``fields`` (flat field/value pairs) to append."""
    keys: list[str] = [name for names, _, _, _ in writes for name in names]
    keys += [name for _, deletes, _, _ in writes for name in deletes]
    args: list[bytes | str | int] = [len(writes)]
    for names, deletes, data, ttl_ms in writes:
        args += [len(names), len(deletes), data, ttl_ms]
    if stream is not None:
        keys.append(stream)
        args.append(maxlen)
        args += fields
    return keys, args


# KEYS: the name to SET, the lease to DEL, then the stream if the write is announced.
# ARGV: the data and its TTL (ms), then, if announced, the stream's MAXLEN and the
# entry's field/value pairs. Returns what ``WRITE_SCRIPT`` returns; same order, same
# reasons (the SET first, the append under ``pcall``).
WRITE_ONE_SCRIPT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
if KEYS[3] == nil then
  return 1
end
local reply = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
if type(reply) == 'table' and reply.err then
  return reply.err
end
return 1
"""


def write_script_args(
    writes: Sequence[tuple[Sequence[str], Sequence[str], bytes, int]],
    stream: str | None = None,
    maxlen: int = 0,
    fields: Sequence[bytes | str] = (),
) -> tuple[bool, list[str], list[bytes | str | int]]:
    """Whether ``WRITE_ONE_SCRIPT`` takes ``writes`` (one name and its lease: a key that
    is not hot), and the KEYS and ARGV of the script that does."""
    if len(writes) != 1 or len(writes[0][0]) != 1 or len(writes[0][1]) != 1:
        return False, *write_args(writes, stream, maxlen, fields)
    (name,), (lease,), data, ttl_ms = writes[0]
    if stream is None:
        return True, [name, lease], [data, ttl_ms]
    return True, [name, lease, stream], [data, ttl_ms, maxlen, *fields]
