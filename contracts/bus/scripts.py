"""The Lua scripts that make each write atomic: the fence every writing script starts with, the
hop, issuing jobs, renewing claims, the ledger snapshot and the learner lease. On Redis 7 they
run as one function library the administrator loads (`contracts.bus.library`).

A Lua script runs as one atomic step in Redis (like MULTI/EXEC) and can make its writes
conditional, which MULTI/EXEC cannot: the hop writes nothing when its entry was already
acknowledged by someone else, and a fenced write nothing when its writer lost the learner lease.
The repairs of planted values inside the scripts are Lua functions of their own (`COUNT`,
`MAKE_ROOM_FOR_STREAM`), so each script's normal path reads in a few lines.
"""

from __future__ import annotations

from contracts.keys import LEDGER_DAMAGED

# Every script of the bus reads its keys from ARGV (a count, then the keys), never from Redis's
# KEYS: Redis 7 demands write permission on each key a script or function declares, whatever it
# does with it, so a read-only role (the API) could not take a ledger snapshot, and a placeholder
# '' key (an unfenced writer's lease, a hop with no downstream) would be refused to everyone.
# Each command a script runs is still checked against the caller's Redis user, key by key, read
# or write (`contracts.bus.roles`). Declared keys only matter to Redis Cluster, which this system
# does not use (one run's streams and ledger live on one server). `BusScripts.run` passes them
# this way.
KEYS_FROM_ARGV = """
for i = 1, tonumber(table.remove(ARGV, 1)) do KEYS[i] = table.remove(ARGV, 1) end
"""

# Every writing script starts with the fence: KEYS[1] is the learner lease key ("" = unfenced),
# ARGV[1] the token the writer holds and ARGV[2] the lease TTL in ms; they are removed before
# the script's own arguments. A writer whose token is no longer the lease's (another learner
# took over after it lost the lease) writes nothing. A vacant lease (Redis lost its data, or
# the holder was paused past the TTL and nobody took over) is taken back: nobody else wrote
# meanwhile, so the holder may go on. Checked inside Redis, in the same atomic step as the write.
FENCE = (
    KEYS_FROM_ARGV
    + """
local lease = table.remove(KEYS, 1)
local token = table.remove(ARGV, 1)
local ttl_ms = table.remove(ARGV, 1)
if lease ~= '' then
  local holder = redis.call('GET', lease)
  if holder == false then
    redis.call('SET', lease, token, 'PX', ttl_ms)
  elseif holder ~= token then
    return redis.error_reply('FENCED this writer no longer holds the learner lease')
  end
end
"""
)

# One fenced command: ARGV (after the fence) is the command and its arguments.
CALL = FENCE + "return redis.call(unpack(ARGV))\n"

# The same, for a command whose key (KEYS[1]) holds another type than it needs (ARGV[1]): the key
# is deleted first, unless it already holds that type or nothing, in one atomic step, so two
# writers that both met the wrong type cannot delete each other's fresh writes. Returns
# {the type it found, the command's reply}.
REPLACE_AND_CALL = (
    FENCE
    + """
local expected = table.remove(ARGV, 1)
local found = redis.call('TYPE', KEYS[1]).ok
if found ~= 'none' and found ~= expected then
  redis.call('DEL', KEYS[1])
end
return {found, redis.call(unpack(ARGV))}
"""
)

# Counting inside the writing scripts (the ledger, the counters). A planted value must not fail
# the script after its stream writes are done (Redis does not roll a script back) nor every later
# one: a hash key of another type is replaced, a field that is not an integer (or would
# overflow) restarts at the increment. Returns what it repaired ('' = nothing) for the caller to
# log and count as a bad value. The ledger keeps a mark (LEDGER_DAMAGED) once a count of it was
# lost: its figures are not the run's for the rest of the run, though each reads as an integer
# again. Any other error fails the script as before.
COUNT = """
local function count(key, field, n, damage_mark)
  local reply = redis.pcall('HINCRBY', key, field, n)
  if type(reply) ~= 'table' or not reply.err then return '' end
  if string.find(reply.err, 'WRONGTYPE', 1, true) then
    redis.call('DEL', key)
  elseif string.find(reply.err, 'not an integer', 1, true)
      or string.find(reply.err, 'overflow', 1, true) then
    redis.call('HDEL', key, field)
  else
    error(reply)  -- fails the script with Redis's own error
  end
  redis.call('HINCRBY', key, field, n)
  if damage_mark ~= '' then redis.call('HSET', key, damage_mark, 1) end
  return field .. ': ' .. reply.err
end
"""

# A stream key that holds another type (planted) would fail the XADD after the XACK and lose the
# entry: it is deleted first (its consumer group comes back with the readers' `ensure_groups`).
# Returns what it replaced ('' = nothing), for the caller to count as a bad value.
MAKE_ROOM_FOR_STREAM = """
local function make_room_for_stream(key)
  local kind = redis.call('TYPE', key).ok
  if kind == 'stream' or kind == 'none' then return '' end
  redis.call('DEL', key)
  return 'a ' .. kind .. ' where a stream belongs'
end
"""

# The hop. KEYS: upstream, downstream ("" = none), ledger, counters. ARGV: group, entry id,
# ledger field ("" = none), counter field ("" = none), downstream MAXLEN ("" = unbounded), then
# the field/value pairs to append downstream. Returns {1 (0: already acknowledged by someone
# else, nothing written), ledger repair, counter repair, downstream repair}.
HOP = (
    FENCE
    + COUNT
    + MAKE_ROOM_FOR_STREAM
    + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return {0, '', '', ''} end
redis.call('XDEL', KEYS[1], ARGV[2])
local downstream_repair, ledger_repair, counter_repair = '', '', ''
if KEYS[2] ~= '' and #ARGV > 5 then
  downstream_repair = make_room_for_stream(KEYS[2])
  local xadd = {KEYS[2], '*'}
  if ARGV[5] ~= '' then xadd = {KEYS[2], 'MAXLEN', '~', ARGV[5], '*'} end
  for i = 6, #ARGV do xadd[#xadd + 1] = ARGV[i] end
  redis.call('XADD', unpack(xadd))
end
if ARGV[3] ~= '' then ledger_repair = count(KEYS[3], ARGV[3], 1, '"""
    + LEDGER_DAMAGED
    + """') end
if ARGV[4] ~= '' then counter_repair = count(KEYS[4], ARGV[4], 1, '') end
return {1, ledger_repair, counter_repair, downstream_repair}
"""
)

# KEYS: prompts stream, ledger. ARGV: ledger field, n_fields, then n_fields*2 values per job,
# repeated. Returns {jobs appended, ledger repair}.
ISSUE = (
    FENCE
    + COUNT
    + """
local n = tonumber(ARGV[2])
local appended = 0
local i = 3
while i <= #ARGV do
  local kv = {}
  for j = i, i + 2 * n - 1 do kv[#kv + 1] = ARGV[j] end
  redis.call('XADD', KEYS[1], '*', unpack(kv))
  appended = appended + 1
  i = i + 2 * n
end
local repair = count(KEYS[2], ARGV[1], appended, '"""
    + LEDGER_DAMAGED
    + """')
return {appended, repair}
"""
)


# KEYS: stream. ARGV: group, consumer, entry ids. Resets the idle time of each entry still
# pending under this consumer (XCLAIM JUSTID does not count a delivery); one another consumer
# took over meanwhile is left alone.
RENEW_CLAIMS = (
    KEYS_FROM_ARGV
    + """
local renewed = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    renewed = renewed + 1
  end
end
return renewed
"""
)

# Read-only, so Redis runs it even at maxmemory (a MULTI/EXEC would be refused there).
# KEYS: ledger, then every stage stream. Returns [the ledger key's type, HGETALL ledger (empty
# unless a hash), XLEN stream...].
LEDGER = (
    KEYS_FROM_ARGV
    + """
local kind = redis.call('TYPE', KEYS[1]).ok
local fields = {}
if kind == 'hash' then fields = redis.call('HGETALL', KEYS[1]) end
local out = {kind, fields}
for i = 2, #KEYS do out[#out + 1] = redis.call('XLEN', KEYS[i]) end
return out
"""
)

# The learner lease (`contracts.lease`). KEYS: lease. ARGV: token, TTL ms. Extends the lease
# while it holds our token, takes it back when vacant (as a fenced write does), and returns 0
# when another learner holds it.
LEASE_RENEW = (
    KEYS_FROM_ARGV
    + """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder == false then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""
)

# KEYS: lease. ARGV: token. Gives the lease up only if it is still ours.
LEASE_RELEASE = (
    KEYS_FROM_ARGV
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
)
