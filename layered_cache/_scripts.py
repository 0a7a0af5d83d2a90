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
- ``WRITE_ONE`` (a single node only): ``set()``'s write of one key that is not hot -
  its SET, the DEL of its lease (a fill in flight must not land after it) and the
  backplane append - as one step (``_write_commands`` says why one step, and why a
  write of more names is a MULTI/EXEC instead). Redis ran it in ~18 µs
  (``INFO commandstats``, bench VM). ``APPEND`` is its append alone, the last command
  of that MULTI/EXEC: the same Lua (``_append``), so both publish a refused append.
- ``RESERVE`` / ``SET_RESERVED`` (a cluster only): a hot key's replica leases, reserved
  by a fill or a copy unless a ``set()`` holds them, and a ``set()``'s replica written
  only under its own reservation (``_replicas`` says why). Each reads the lease and
  writes in one step, or a reservation taken between the read and the write is lost.
- ``FETCH`` / ``PEEK``: tags (``_tags`` says why each is one step). The loading set
  is taken in no script: ``_loading.take_loading`` says why.
- ``RECORD_COUNTS``: the fleet's replica counts (``_invalidation.check_replica_counts``)
  compared and recorded in one step, so that a process refused for its count records
  nothing: field by field (``HSETNX`` each, then compare), it left the fields it was
  first to write, and once corrected it was refused by its own leftovers.
"""

from __future__ import annotations

__all__ = [
    "APPEND_SCRIPT",
    "FETCH_SCRIPT",
    "FILL_SCRIPT",
    "NOTIFY_INLINE_MAX",
    "PEEK_SCRIPT",
    "READ_UNDER_LEASE_SCRIPT",
    "RECORD_COUNTS_SCRIPT",
    "RELEASE_SCRIPT",
    "RESERVE_SCRIPT",
    "SET_RESERVATION",
    "SET_RESERVED_SCRIPT",
    "WRITE_ONE_SCRIPT",
    "fill_args",
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


# What a cluster set()'s reservation tokens start with (``_replicas.write_many``); no
# lease token of a fill or a copy does (hex digits: ``_stampede.new_token``).
SET_RESERVATION = "set:"

# A fill's or a copy's reservation of a replica lease in a cluster: SET unless a set()
# holds it (its token starts with SET_RESERVATION). Taken over, the set's own replica
# write (SET_RESERVED) fails, while the fill, whose check may have passed before the
# set's base write, writes its older value there: base new, replica old. Refused, the
# fill's guarded write of that replica fails instead, and the set's lands. A lease of
# another type (another client's) is overwritten, as a plain SET would. Returns 1 if set.
RESERVE_SCRIPT = """
local held = redis.pcall('GET', KEYS[1])
if type(held) == 'string' and string.sub(held, 1, 4) == 'set:' then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# Phase 2 of a cluster set() of a hot key: KEYS replica, its lease; ARGV the set's
# token, data, TTL (ms). Writes the replica only while the set's reservation holds its
# lease (releasing it), as a fill's guarded write: an invalidation that ran since the
# reservation deleted it, so the write fails and leaves nothing. Else the replica is
# deleted: a reservation that expired first would leave it older than the base, and a
# missing replica is only a read of the base key (and a copy back).
SET_RESERVED_SCRIPT = """
if redis.pcall('GET', KEYS[2]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  redis.call('DEL', KEYS[2])
  return 1
end
redis.call('DEL', KEYS[1])
return 0
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


def _append(stream: str, maxlen: str, first: int) -> str:
    """Lua that appends set()'s backplane entry (ARGV from ``first`` on: its field/value
    pairs) to ``stream``, trimmed to about ``maxlen``, and returns 1. A stream that
    refuses it (a WRONGTYPE name, ...) after the SETs: the entry goes over the stream's
    pub/sub fallback channel instead (``_fallback.fallback_channel``,
    ``FallbackMessage``: the entry's ``keys`` and ``origin``), in the same step. Only so
    does a write that lands after its caller left (cancelled, timed out: nobody reads
    its reply) still reach every instance. Returns the XADD's error in a one-element
    array when published so, the error alone when the PUBLISH failed too (the caller
    announces another way): ``_write_commands.script_append``. Text, not a Lua function
    both scripts call: set()'s script then builds no closure per call."""
    return f"""
local reply = redis.pcall('XADD', {stream}, 'MAXLEN', '~', {maxlen}, '*', unpack(ARGV, {first}))
if type(reply) ~= 'table' or not reply.err then
  return 1
end
local message = {{}}
for i = {first}, #ARGV, 2 do
  if ARGV[i] == 'keys' then
    message.keys = cmsgpack.unpack(ARGV[i + 1])
  else
    message[ARGV[i]] = ARGV[i + 1]
  end
end
local sent = redis.pcall('PUBLISH', {stream} .. ':fallback', cmsgpack.pack(message))
if type(sent) == 'table' and sent.err then
  return reply.err
end
return {{reply.err}}
"""


# KEYS: the name to SET, the lease to DEL, then the stream if the write is announced.
# ARGV: the data and its TTL (ms), then, if announced, the stream's MAXLEN and the
# entry's field/value pairs. The SET first and the append under ``pcall``, for the
# reasons ``_write_commands`` gives; returns what ``_append`` does (1 if not announced).
WRITE_ONE_SCRIPT = (
    """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
if KEYS[3] == nil then
  return 1
end"""
    + _append("KEYS[3]", "ARGV[3]", 4)
)

# The append of a MULTI/EXEC write (``_write_commands``), its last command, as EVAL.
# KEYS: the stream; ARGV: its MAXLEN, then the entry's field/value pairs.
APPEND_SCRIPT = _append("KEYS[1]", "ARGV[1]", 2)


# Tags (``_tags``).

# Fetch a tag's token, creating one if the tag has none, or has a string no writer of
# ours made (16 lowercase hex digits: ``_tags.new_version``; another client's SET, bytes
# that aren't even UTF-8, stayed for good, every writer refused), and extend the key's
# life to at least ARGV[2] ms (never shorten it: another instance's entries may live
# longer; a key from before tokens expired, with no TTL, gets one). A key of another
# type (a hash, a list: another client's) is replaced too: its GET's WRONGTYPE failed
# every fetch of the tag, and nothing carrying it was ever cached again.
FETCH_SCRIPT = """
local current = false
if redis.call('TYPE', KEYS[1]).ok == 'string' then
  current = redis.call('GET', KEYS[1])
end
if not current or string.len(current) ~= 16 or string.find(current, '[^0-9a-f]') then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('GET', KEYS[1])
"""

# A reader's fetch: the tag's token if it has one (its key's life extended as FETCH's,
# ARGV[1] ms), nil if not. Readers create no token key: an entry whose tag has none is
# dead anyway (no new random token could match it), and a reader that created them let
# a value planted with made-up tags fill Redis with a day's keys per tag: one get_many
# of 100 planted entries of 1,000 tags each made 100,000. A key of another type is no
# token either (its entries are dead; the next writer's FETCH replaces it).
PEEK_SCRIPT = """
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then
  return false
end
local version = redis.call('GET', KEYS[1])
if version and redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return version
"""


# KEYS[1] the replica record; ARGV field, count, field, count, ...: every field recorded
# with another count, with it (field, recorded, ...); nothing is written unless none is.
# A record of another type (another client's SET) is replaced: its WRONGTYPE read as
# "Redis unreachable" at start, and every process started unchecked. Only missing fields
# are written: a Redis full under noeviction refuses any write, and a fleet that
# recorded everything already is checked with reads alone (``check_replica_counts``).
RECORD_COUNTS_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'hash' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])
end
local wrong, missing = {}, {}
for i = 1, #ARGV, 2 do
  local seen = redis.call('HGET', KEYS[1], ARGV[i])
  if not seen then
    missing[#missing + 1] = i
  elseif seen ~= ARGV[i + 1] then
    wrong[#wrong + 1] = ARGV[i]
    wrong[#wrong + 1] = seen
  end
end
if #wrong == 0 then
  for _, i in ipairs(missing) do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return wrong
"""
