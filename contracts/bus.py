"""The Redis streams transport: atomic hops, reclaim, dead letters and the ledger.

Every stage reads its stream through a consumer group (XREADGROUP), does its work, then makes
one atomic *hop*: a Lua script that acknowledges and deletes the upstream entry, appends the
result downstream and updates the ledger. A Lua script is one atomic step like MULTI/EXEC, and
it can also make the hop conditional: if XACK reports the entry was already acknowledged (a
slow worker whose entry was reclaimed by another finished first), nothing is written, so a
group is never forwarded twice.

Because acknowledged entries are deleted, a stage stream's length is exactly the work waiting
or being processed at that stage, and the ledger balance is a real check, not a tautology:

    issued + eval_issued == trained + filtered + stale + dead + evaluated + eval_dead
                            + sum(XLEN of the five stage streams)

(two lanes: training jobs end trained, filtered, stale or dead; evaluation jobs end evaluated or
eval_dead).

When Redis reaches `maxmemory` (policy `noeviction`, which `check_memory_policy` insists on)
it refuses plain writes that may grow its memory (XADD, SET, HINCRBY, ...). Clients from
`connect()` then *pause*: they log one clear error, retry the refused command with back-off
until Redis accepts it, and count the pause. Nothing is dropped: issuing new jobs is refused
whole (its first write is an XADD), and a hop script always runs whole (its first write, XACK,
is not refused, and Redis never stops a script half-way). So hops in progress still complete
and Redis can overshoot maxmemory by at most the groups of the jobs already in flight (bounded
by admission control), while everything else waits until memory is freed or maxmemory raised.

What this does NOT guarantee: work done by a worker that dies before its hop is redone by
whoever reclaims the entry (at-least-once processing, exactly-once forwarding).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from pydantic import TypeAdapter, ValidationError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from contracts.keys import (
    LEDGER_DAMAGED,
    LEDGER_DEAD,
    LEDGER_EVAL_DEAD,
    LEDGER_EVAL_ISSUED,
    LEDGER_FIELDS,
    LEDGER_ISSUED,
    LEDGER_OUTCOMES,
    Counter,
    Keys,
    RunField,
    Stage,
)
from contracts.schemas import ControlRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

Fields = dict[bytes, bytes]
Entry = tuple[str, Fields]

# Every writing script starts with the fence: KEYS[1] is the learner lease key ("" = unfenced),
# ARGV[1] the token the writer holds and ARGV[2] the lease TTL in ms; they are removed before
# the script's own arguments. A writer whose token is no longer the lease's (another learner
# took over after it lost the lease) writes nothing. A vacant lease (Redis lost its data, or
# the holder was paused past the TTL and nobody took over) is taken back: nobody else wrote
# meanwhile, so the holder may go on. Checked inside Redis, in the same atomic step as the write.
_FENCE = """
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

# One fenced command: ARGV (after the fence) is the command and its arguments.
_CALL = _FENCE + "return redis.call(unpack(ARGV))\n"

# The same, for a command whose key (KEYS[1]) holds another type than it needs (ARGV[1]): the key
# is deleted first, unless it already holds that type or nothing, in one atomic step, so two
# writers that both met the wrong type cannot delete each other's fresh writes. Returns
# {the type it found, the command's reply}.
_REPLACE_AND_CALL = (
    _FENCE
    + """
local expected = table.remove(ARGV, 1)
local found = redis.call('TYPE', KEYS[1]).ok
if found ~= 'none' and found ~= expected then
  redis.call('DEL', KEYS[1])
end
return {found, redis.call(unpack(ARGV))}
"""
)

_KEY_TYPE_OF_WRITE = {
    "HSET": "hash",
    "HINCRBY": "hash",
    "HDEL": "hash",
    "SADD": "set",
    "XADD": "stream",
}
"""The type a write command needs its key (its first argument) to hold: what `write` may replace."""

# Counting inside the writing scripts (the ledger, the counters). A planted value must not fail
# the script after its stream writes are done (Redis does not roll a script back) nor every later
# one: a hash key of another type is replaced, a field that is not an integer (or would
# overflow) restarts at the increment. Returns what it repaired ('' = nothing) for the caller to
# log and count as a bad value. The ledger keeps a mark (LEDGER_DAMAGED) once a count of it was
# lost: its figures are not the run's for the rest of the run, though each reads as an integer
# again. Any other error fails the script as before.
_COUNT = """
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

# KEYS: upstream, downstream ("" = none), ledger, counters
# ARGV: group, entry id, ledger field ("" = none), counter field ("" = none), downstream MAXLEN
# ("" = unbounded), then field/value pairs for XADD downstream.
# Returns {1 (0: already acknowledged by someone else, nothing written), ledger repair, counter
# repair, downstream repair}. A downstream key of another type is replaced (its consumer group
# comes back with the readers' `ensure_groups`): failing the XADD after the XACK would lose the
# entry.
_HOP = (
    _FENCE
    + _COUNT
    + """
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 0 then return {0, '', '', ''} end
redis.call('XDEL', KEYS[1], ARGV[2])
local downstream_repair = ''
if KEYS[2] ~= '' and #ARGV > 5 then
  local kind = redis.call('TYPE', KEYS[2]).ok
  if kind ~= 'stream' and kind ~= 'none' then
    redis.call('DEL', KEYS[2])
    downstream_repair = 'a ' .. kind .. ' where a stream belongs'
  end
  local kv = {}
  for i = 6, #ARGV do kv[#kv + 1] = ARGV[i] end
  if ARGV[5] ~= '' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(kv))
  else
    redis.call('XADD', KEYS[2], '*', unpack(kv))
  end
end
local ledger_repair, counter_repair = '', ''
if ARGV[3] ~= '' then ledger_repair = count(KEYS[3], ARGV[3], 1, '"""
    + LEDGER_DAMAGED
    + """') end
if ARGV[4] ~= '' then counter_repair = count(KEYS[4], ARGV[4], 1, '') end
return {1, ledger_repair, counter_repair, downstream_repair}
"""
)

# KEYS: prompts stream, ledger. ARGV: ledger field, n_fields, then n_fields*2 values per job,
# repeated. Returns {jobs appended, ledger repair}.
_ISSUE = (
    _FENCE
    + _COUNT
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
_RENEW_CLAIMS = """
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

# Read-only, so Redis runs it even at maxmemory (a MULTI/EXEC would be refused there).
# KEYS: ledger, then every stage stream. Returns [the ledger key's type, HGETALL ledger (empty
# unless a hash), XLEN stream...].
_LEDGER = """
local kind = redis.call('TYPE', KEYS[1]).ok
local fields = {}
if kind == 'hash' then fields = redis.call('HGETALL', KEYS[1]) end
local out = {kind, fields}
for i = 2, #KEYS do out[#out + 1] = redis.call('XLEN', KEYS[i]) end
return out
"""

OOM_PAUSE_COUNTER = Counter.REDIS_OOM_PAUSES.value

BAD_VALUES_REMEMBERED = 1000
"""Malformed (key, value) pairs a process remembers so it logs and counts each once."""

WRONGTYPE = "WRONGTYPE"
"""Redis's error code for a command on a key of another type (also inside a script's error)."""

DEAD_LETTER_MAXLEN = 10_000
"""Dead-letter records kept (about; trimmed approximately). Older records are dropped; every
dead letter is still counted in the ledger and the counters."""

OWN_IDLE_MS = 1000
"""A consumer's own pending entry idle this long, while it holds none, is an orphan (reclaim)."""

GONE_AFTER_TTLS = 2
"""A consumer whose heartbeat is absent is gone once its pending entries sat this many heartbeat
TTLs (`reclaim`, `heartbeat_ttl_s`); a consumer whose heartbeat is present keeps its entries
until `queue.claim_idle_s`."""


class FencedError(RuntimeError):
    """A write was refused because this process no longer holds the learner lease: another
    learner took over (see `contracts.lease`). The process must stop writing and exit."""


def is_oom(exc: redis.ResponseError) -> bool:
    """Redis refused a write at maxmemory (Redis 7 says OOM; 6.2 wraps it inside a script error)."""
    return isinstance(exc, redis.OutOfMemoryError) or "OOM command not allowed" in str(exc)


class PausingRedis(redis.Redis):
    """A client that waits out Redis at `maxmemory` instead of failing the caller.

    A refused command (OOM) is retried with back-off (0.5 s doubling to 5 s) until Redis accepts
    it; the first refusal logs a clear error, and the pause is counted under
    `OOM_PAUSE_COUNTER` in `counters_key` once Redis accepts writes again. If `stop` is set
    while paused the error is raised, so a process asked to exit is not held by a full Redis.
    """

    stop: threading.Event | None = None
    counters_key: str | None = None

    def execute_command(self, *args: Any, **options: Any) -> Any:
        paused_at: float | None = None
        delay = 0.5
        while True:
            try:
                result = super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                if not is_oom(exc):
                    raise
                if self.stop is not None and self.stop.is_set():
                    raise
                if paused_at is None:
                    paused_at = time.monotonic()
                    log.error(
                        "Redis is at maxmemory and refused %s: pausing until it accepts writes "
                        "again (raise the server's maxmemory, or lower algorithm.max_staleness / "
                        "oversampling so less work is queued); nothing has been dropped",
                        args[0],
                    )
                if self.stop is not None:
                    self.stop.wait(delay)
                else:
                    time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if paused_at is not None:
                log.warning(
                    "Redis accepts writes again; resumed after a %.1fs pause",
                    time.monotonic() - paused_at,
                )
                if self.counters_key:
                    with contextlib.suppress(
                        redis.RedisError
                    ):  # a count is not worth another pause
                        super().execute_command("HINCRBY", self.counters_key, OOM_PAUSE_COUNTER, 1)  # type: ignore[no-untyped-call]
            return result


def connect(
    url: str,
    *,
    retries: int = 8,
    pause_when_full: bool = True,
    stop: threading.Event | None = None,
    counters_key: str | None = None,
    socket_timeout: float | None = None,
) -> redis.Redis:
    """A client that retries with bounded exponential back-off when the server goes away and,
    with `pause_when_full` (services; not the API, which answers 503 instead), waits out Redis
    at maxmemory (see `PausingRedis`)."""
    cls = PausingRedis if pause_when_full else redis.Redis
    client = cls.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=10,
        socket_keepalive=True,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
    )
    if isinstance(client, PausingRedis):
        client.stop, client.counters_key = stop, counters_key
    return client


def open_bus(
    url: str,
    namespace: str,
    consumer: str,
    *,
    pause_when_full: bool = True,
    retries: int = 8,
    stop: threading.Event | None = None,
    socket_timeout: float | None = None,
) -> StreamBus:
    """The one way every process connects: a `StreamBus` for the run's namespace.

    Services pause at maxmemory (`pause_when_full`); the API and the supervisor do not (they
    answer 503 or keep supervising instead)."""
    keys = Keys(namespace)
    client = connect(
        url,
        retries=retries,
        pause_when_full=pause_when_full,
        stop=stop,
        counters_key=keys.counters,
        socket_timeout=socket_timeout,
    )
    return StreamBus(client, keys, consumer=consumer)


def check_memory_policy(client: redis.Redis) -> None:
    """Refuse a Redis that would evict keys under memory pressure: that is silent data loss."""
    mem: Any = client.info("memory")
    policy = str(mem.get("maxmemory_policy", "noeviction"))
    if int(mem.get("maxmemory", 0)) > 0 and policy != "noeviction":
        raise RuntimeError(
            f"Redis maxmemory-policy is {policy!r}: under memory pressure Redis would delete "
            "queued samples; set it to noeviction (the run then pauses at maxmemory instead of "
            "losing data)"
        )


def memory_report(client: redis.Redis) -> dict[str, Any]:
    """Redis memory as /status shows it: used, peak, limit, and whether writes are being refused."""
    mem: Any = client.info("memory")
    limit = int(mem.get("maxmemory", 0))
    used = int(mem.get("used_memory", 0))
    counted = used - int(
        mem.get("mem_not_counted_for_evict", 0)
    )  # what Redis compares with the limit
    return {
        "used_bytes": used,
        "peak_bytes": int(mem.get("used_memory_peak", 0)),
        "maxmemory_bytes": limit,
        "policy": str(mem.get("maxmemory_policy", "")),
        "at_maxmemory": bool(limit and counted >= limit),
    }


@dataclass(frozen=True)
class LedgerSnapshot:
    issued: int
    trained: int
    filtered: int
    stale: int
    dead: int
    in_flight: int
    """Entries still in a stage stream (waiting or being processed), both lanes,
    measured with XLEN."""
    eval_issued: int = 0
    evaluated: int = 0
    eval_dead: int = 0
    damaged: bool = False
    """The ledger held a planted value (read as 0, skipped and counted):
    its figures are not the run's."""

    @property
    def balanced(self) -> bool:
        ended = (
            self.trained + self.filtered + self.stale + self.dead + self.evaluated + self.eval_dead
        )
        return not self.damaged and self.issued + self.eval_issued == ended + self.in_flight

    @property
    def eval_in_flight(self) -> int:
        """Evaluation jobs not yet evaluated or dead (by the lane's own counts)."""
        return self.eval_issued - self.evaluated - self.eval_dead

    @property
    def train_in_flight(self) -> int:
        """Training jobs still in a stream: what admission control and the drain look at.
        The evaluation lane's share is bounded by what the streams hold (a no-op for an intact
        ledger), so a damaged ledger can skew admission for a while but never stall it."""
        return self.in_flight - min(max(self.eval_in_flight, 0), self.in_flight)

    def as_dict(self) -> dict[str, int | bool]:
        return {
            "issued": self.issued,
            "trained": self.trained,
            "filtered": self.filtered,
            "stale": self.stale,
            "dead": self.dead,
            "eval_issued": self.eval_issued,
            "evaluated": self.evaluated,
            "eval_dead": self.eval_dead,
            "in_flight": self.in_flight,
            "balanced": self.balanced,
            "damaged": self.damaged,
        }


def pass_rate(kept: int, filtered: int) -> float | None:
    """The gatekeeper's pass rate: share of gated groups that were kept; None before any."""
    return kept / (kept + filtered) if kept + filtered else None


_CONTROL = TypeAdapter(ControlRequest)
METRICS_MAXLEN = 100_000
"""Per-step metric records kept in Redis (a 32B run takes far fewer steps)."""


class StreamBus:
    """The pipeline's streams and run state for one namespace, as seen by one consumer.

    The only way into Redis: the stages and the application use these methods; `redis` (the
    raw client) is for the other contracts modules (heartbeats, the weight-sync protocol) only.
    """

    def __init__(self, client: redis.Redis, keys: Keys, consumer: str) -> None:
        self.redis = client
        self.keys = keys
        self.consumer = consumer
        self._hop_script = client.register_script(_HOP)
        self._issue_script = client.register_script(_ISSUE)
        self._call = client.register_script(_CALL)
        self._replace_and_call = client.register_script(_REPLACE_AND_CALL)
        self._ledger = client.register_script(_LEDGER)
        self._renew_claims = client.register_script(_RENEW_CLAIMS)
        self._bad_seen: set[tuple[str, bytes | str]] = set()  # see skip_bad_value
        self.fence: tuple[str, str, int] = ("", "", 0)
        """(lease key, token, TTL ms) once this bus writes for a lease holder (`hold_fence`);
        every write of the run state then happens only while the token is the lease's."""

    def as_consumer(self, consumer: str) -> StreamBus:
        """The same streams and connection, read under another consumer name (the learner's
        drain reads undelivered jobs without taking over its own pending entries)."""
        other = StreamBus(self.redis, self.keys, consumer)
        other.fence = self.fence
        return other

    def hold_fence(self, token: str, ttl_s: float) -> None:
        """Write only while the learner lease holds `token` (the learner, after taking it)."""
        self.fence = (self.keys.learner_lease, token, int(ttl_s * 1000))

    def _fenced(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        lease, token, ttl_ms = self.fence
        try:
            return script(keys=[lease, *keys], args=[token, ttl_ms, *args])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise FencedError(
                    f"refused a write to Redis: this learner's lease token {self.fence[1]!r} was "
                    "superseded (another learner holds the lease now)"
                ) from None
            raise

    def write(self, *command: Any) -> Any:
        """One write command (e.g. `write("HSET", key, field, value)`), fenced when this bus holds
        a fence; the raw Redis reply (no client-side parsing).

        A key of the wrong type (planted, or left by something else) would refuse this write
        for good: for the commands in `_KEY_TYPE_OF_WRITE` it is replaced and the write done
        (`_REPLACE_AND_CALL`), then counted as a bad value."""
        try:
            return self._write_once(*command)
        except redis.ResponseError as exc:
            needs = _KEY_TYPE_OF_WRITE.get(str(command[0]).upper())
            if WRONGTYPE not in str(exc) or needs is None:
                raise
        found, reply = self._fenced(self._replace_and_call, [command[1]], [needs, *command])
        found = found.decode() if isinstance(found, bytes) else str(found)
        if found not in (needs, "none"):  # else another writer replaced it first
            self.skip_bad_value(command[1], f"a {found} where a {needs} belongs; replaced")
        return reply

    def _write_once(self, *command: Any) -> Any:
        if not self.fence[0]:
            return self.redis.execute_command(*command)  # type: ignore[no-untyped-call]
        return self._fenced(self._call, [], list(command))

    def _int_at(self, key: Any, raw: bytes | None, default: T) -> int | T:
        """An integer read from `key`; anything else is skipped and counted like any malformed
        value, and reads as `default` (as does a missing value)."""
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            self.skip_bad_value(key, f"{raw!r} is not an integer", raw)
            return default

    def _read(self, default: Any, read: Callable[..., Any], key: Any, *args: Any) -> Any:
        """`read(key, *args)` (a client method: `hgetall`, `get`, ...), where a key of the wrong
        type (a hash where a string belongs, ...) is a malformed value like any other: skipped
        and counted, and `default` returned."""
        try:
            return read(key, *args)
        except redis.ResponseError as exc:
            if WRONGTYPE not in str(exc):
                raise
            self.skip_bad_value(key, "a value of the wrong type")
            return default

    def ensure_groups(self) -> None:
        """Create every stage's consumer group (idempotent; MKSTREAM creates the stream)."""
        for stage in self.keys.stages:
            try:
                self.redis.xgroup_create(stage.stream, stage.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # --- producing --------------------------------------------------------------------------
    def issue(self, encoded_jobs: list[dict[str, bytes]], *, evaluation: bool = False) -> int:
        """Append prompt jobs and count them as issued (`eval_issued` for evaluation jobs),
        atomically."""
        if not encoded_jobs:
            return 0
        names = list(encoded_jobs[0])
        argv: list[Any] = [LEDGER_EVAL_ISSUED if evaluation else LEDGER_ISSUED, len(names)]
        for job in encoded_jobs:
            if list(job) != names:
                raise ValueError("every issued job must have the same fields in the same order")
            for name in names:
                argv += [name, job[name]]
        appended, repair = self._fenced(
            self._issue_script, [self.keys.prompts.stream, self.keys.ledger], argv
        )
        self._count_repair(self.keys.ledger, repair)
        return int(appended)

    # --- consuming --------------------------------------------------------------------------
    def read(self, stage: Stage, *, count: int, block_ms: int | None) -> list[Entry]:
        """New entries for this consumer (blocking up to block_ms when there are none; None:
        never blocks)."""
        try:
            reply: Any = self.redis.xreadgroup(
                stage.group, self.consumer, {stage.stream: ">"}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis came back empty (restarted without persistence): recreate the groups. The
            # learner detects the loss and reports it; here we just keep working.
            log.error("consumer group %s is gone (Redis lost its data?); recreating", stage.group)
            self.ensure_groups()
            return []
        return [(eid.decode(), fields) for _, entries in reply or [] for eid, fields in entries]

    def renew_claims(self, stage: Stage, entry_ids: list[str]) -> int:
        """Mark entries this consumer is still working on as fresh (their idle time restarts),
        so `reclaim` by others only takes a dead consumer's work; returns how many were ours."""
        if not entry_ids:
            return 0
        return int(
            self._renew_claims(keys=[stage.stream], args=[stage.group, self.consumer, *entry_ids])
        )

    @contextlib.contextmanager
    def claims_kept(self, stage: Stage, entry_ids: list[str], every_s: float) -> Iterator[None]:
        """While the block runs, renew the claims on `entry_ids` every `every_s` (a third of
        `queue.claim_idle_s`) from a daemon thread: work that takes longer than the claim timeout
        (a GPU batch of long responses) is not taken over and done twice while it is alive.
        What this does NOT do: keep a hung worker's claim alive forever (its thread renews as
        long as the process lives; the heartbeat and the supervisor deal with hung processes)."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(every_s):
                try:
                    self.renew_claims(stage, entry_ids)
                except redis.RedisError as exc:  # a restarting Redis: the next round retries
                    log.warning("could not renew claims on %s: %s", stage.stream, exc)

        thread = threading.Thread(target=renew, name="claim-renewer", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(
                timeout=5.0
            )  # a renewal stuck on an unresponsive Redis must not hold the worker

    def reclaim(
        self,
        stage: Stage,
        *,
        min_idle_s: float,
        max_deliveries: int,
        count: int = 16,
        heartbeat_ttl_s: float | None = None,
    ) -> list[Entry]:
        """Take over entries idle longer than min_idle_s (their consumer presumably died), and
        this consumer's own pending entries idle over a second. With `heartbeat_ttl_s` (the
        stages'), also the entries of a consumer whose heartbeat is gone, once idle
        GONE_AFTER_TTLS heartbeat TTLs (`_take_from_gone`).

        Call it only while holding no entries of `stage` (the stage loops call it between
        batches). Then any entry still pending under this consumer's own name is one it will
        never finish by itself: a delivery whose reply was lost when the connection dropped and
        the client retried the read (a Redis restart), or one its handler failed on. Those are
        redone now rather than after `claim_idle_s`.

        Entries already delivered max_deliveries times are dead-lettered instead: a message that
        kills every worker that touches it must not circulate forever.
        """
        own: Any = self.redis.xpending_range(
            stage.stream,
            stage.group,
            min="-",
            max="+",
            count=count,
            consumername=self.consumer,
            idle=OWN_IDLE_MS,
        )
        others: Any = self.redis.xpending_range(
            stage.stream, stage.group, min="-", max="+", count=count, idle=int(min_idle_s * 1000)
        )
        own_ids = {_entry_id(p) for p in own}
        entries = self._take(stage, own_ids, OWN_IDLE_MS, own, max_deliveries)
        entries += self._take(
            stage,
            {_entry_id(p) for p in others} - own_ids,
            int(min_idle_s * 1000),
            others,
            max_deliveries,
        )
        if entries:
            log.warning("reclaimed %d idle entries from %s", len(entries), stage.stream)
        if heartbeat_ttl_s is not None and len(entries) < count:
            gone_idle_ms = int(GONE_AFTER_TTLS * heartbeat_ttl_s * 1000)
            if gone_idle_ms < min_idle_s * 1000:  # else the line above already took them
                entries += self._take_from_gone(
                    stage, gone_idle_ms, count - len(entries), max_deliveries
                )
        return entries

    def _take_from_gone(
        self, stage: Stage, idle_ms: int, count: int, max_deliveries: int
    ) -> list[Entry]:
        """Take over up to `count` pending entries, idle at least `idle_ms`, of other consumers
        whose heartbeat key is absent (expired, or deleted at a clean exit or by the supervisor
        that saw the process die).

        Waiting out `claim_idle_s` for a consumer known to be dead leaves its work in flight for
        minutes, and the end-of-run drain can time out with it still pending. An absent
        heartbeat alone is not proof of death: a beat can be late, a key can expire while Redis
        is down, and a process could read before its first beat (ours beat first, then read).
        Requiring the entries to have sat GONE_AFTER_TTLS TTLs as well means only a consumer that
        has not beaten for that long loses them; a live one beats every third of a TTL.

        What this does NOT guarantee: a consumer that comes back after such a lapse (a process
        paused that long) may find its entries taken and work on them in vain (at-least-once
        work); whichever of the two hops second writes nothing, so nothing is forwarded twice.
        The XCLAIM in `_take` re-checks the idle time, so two stages that find the same entries
        do not both take them."""
        pending: list[Any] = []
        for name in self._gone_consumers(stage):
            got: Any = self.redis.xpending_range(
                stage.stream,
                stage.group,
                min="-",
                max="+",
                count=count - len(pending),
                consumername=name,
                idle=idle_ms,
            )
            if got:
                log.warning(
                    "taking over %d entries of %s from %s: its heartbeat is gone",
                    len(got),
                    stage.stream,
                    _text(name),
                )
            pending += got
            if len(pending) >= count:
                break
        return self._take(stage, {_entry_id(p) for p in pending}, idle_ms, pending, max_deliveries)

    def _gone_consumers(self, stage: Stage) -> list[bytes]:
        """Other consumers holding entries of `stage` whose heartbeat key is absent
        (`Keys.consumer_heartbeat`)."""
        summary: Any = self.redis.xpending(stage.stream, stage.group)
        holders = [
            c["name"] for c in summary.get("consumers") or [] if _text(c["name"]) != self.consumer
        ]
        if not holders:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for name in holders:
                pipe.exists(self.keys.consumer_heartbeat(_text(name)))
            beating = pipe.execute()
        return [name for name, alive in zip(holders, beating, strict=True) if not alive]

    def _take(
        self, stage: Stage, ids: set[str], min_idle_ms: int, pending: Any, max_deliveries: int
    ) -> list[Entry]:
        retry_ids: list[Any] = []
        for p in pending:
            eid = _entry_id(p)
            if eid not in ids:
                continue
            if p["times_delivered"] >= max_deliveries:
                self._dead_letter_by_id(
                    stage, eid, f"delivered {p['times_delivered']} times without completing"
                )
            else:
                retry_ids.append(eid)
        if not retry_ids:
            return []
        claimed: Any = self.redis.xclaim(
            stage.stream, stage.group, self.consumer, min_idle_ms, retry_ids
        )
        return [(eid.decode(), fields) for eid, fields in claimed if fields is not None]

    def hop(
        self,
        stage: Stage,
        entry_id: str,
        *,
        downstream: str | None = None,
        fields: Mapping[str, bytes] | None = None,
        outcome: str | None = None,
        counter: str | None = None,
    ) -> bool:
        """Ack+delete the upstream entry, append `fields` downstream, count `outcome`: atomically.

        Returns False (and writes nothing) if the entry was already acknowledged by someone else.
        """
        if outcome is not None and outcome not in LEDGER_OUTCOMES:
            raise ValueError(f"unknown ledger outcome {outcome!r}")
        # The dead-letter stream is bounded (enough poison must not fill Redis); the pipeline's
        # own streams are bounded by admission control instead, and trimming them would lose work.
        maxlen = DEAD_LETTER_MAXLEN if downstream == self.keys.dead else ""
        argv: list[Any] = [stage.group, entry_id, outcome or "", counter or "", maxlen]
        for name, value in (fields or {}).items():
            argv += [name, value]
        keys = [stage.stream, downstream or "", self.keys.ledger, self.keys.counters]
        done, ledger_repair, counter_repair, downstream_repair = self._fenced(
            self._hop_script, keys, argv
        )
        self._count_repair(self.keys.ledger, ledger_repair)
        self._count_repair(self.keys.counters, counter_repair)
        if downstream:
            self._count_repair(downstream, downstream_repair)
        return bool(done)

    def _count_repair(self, key: str, repair: bytes | str) -> None:
        """A writing script met a planted value where it writes (a count, `_COUNT`, or the
        downstream stream) and replaced it."""
        if repair:
            text = repair.decode("utf-8", "replace") if isinstance(repair, bytes) else repair
            self.skip_bad_value(key, f"{text}; replaced", text)

    def hand_back(self, stage: Stage, entry_id: str, fields: Fields) -> bool:
        """Return an unfinished entry to the head of the work queue (used on SIGTERM)."""
        return self.hop(
            stage,
            entry_id,
            downstream=stage.stream,
            fields={k.decode(): v for k, v in fields.items()},
        )

    def dead_letter(self, stage: Stage, entry_id: str, fields: Fields, reason: str) -> bool:
        """Move an entry to the dead-letter stream with the reason; count it.

        An entry that carries a group id was issued by the feeder and counts as `dead` in the
        ledger (`eval_dead` for an evaluation job); one without (garbage injected into a stream)
        is counted as `poison` only.
        """
        group_id = fields.get(b"group_id") or _group_id_from_meta(fields)
        dead = LEDGER_EVAL_DEAD if is_evaluation(fields) else LEDGER_DEAD
        record = {
            "stage": stage.stream.encode(),
            "entry_id": entry_id.encode(),
            "reason": reason.encode("utf-8", "replace"),
            "group_id": group_id or b"",
            "at": str(time.time()).encode(),
            # Each field cut before encoding: a dead-lettered group may be megabytes of token ids.
            "payload": json.dumps(
                {k.decode("latin-1"): v[:16384].decode("latin-1") for k, v in fields.items()}
            )[:65536].encode(),
        }
        log.error("dead-lettered %s %s: %s", stage.stream, entry_id, reason)
        return self.hop(
            stage,
            entry_id,
            downstream=self.keys.dead,
            fields={k: v for k, v in record.items()},
            outcome=dead if group_id else None,
            counter=Counter.DEAD_LETTERS if group_id else Counter.POISON_MESSAGES,
        )

    def _dead_letter_by_id(self, stage: Stage, entry_id: str, reason: str) -> None:
        got: Any = self.redis.xrange(stage.stream, min=entry_id, max=entry_id, count=1)
        fields = got[0][1] if got else {}
        self.dead_letter(stage, entry_id, fields, reason)

    # --- observing --------------------------------------------------------------------------
    def ledger(self) -> LedgerSnapshot:
        """One consistent snapshot (a read-only script, so it works at maxmemory too).

        A planted value (a ledger key of another type, a count that is not an integer) is skipped
        and counted, and reads as 0: the services go on, and the next count replaces it. The
        counts it held are lost, so the snapshot is `damaged` (never balanced) from then on, for
        the rest of the run (`LEDGER_DAMAGED`), which the run summary and /status report."""
        kind, flat, *lengths = self._ledger(
            keys=[self.keys.ledger, *(stage.stream for stage in self.keys.stages)]
        )
        damaged = kind not in (b"hash", b"none")
        if damaged:  # planted: the next count replaces it
            self.skip_bad_value(
                self.keys.ledger, f"a {kind.decode('utf-8', 'replace')} where a hash belongs"
            )
        counts: dict[str, int] = {}
        for field, raw in zip(flat[::2], flat[1::2], strict=True):
            name, value = (
                field.decode("utf-8", "replace"),
                self._int_at(self.keys.ledger, raw, None),
            )
            damaged |= (
                value is None and name in LEDGER_FIELDS
            )  # a stray field takes nothing from the counts
            counts[name] = value or 0
        damaged |= LEDGER_DAMAGED in counts  # a count was lost earlier and restarted (`_COUNT`)
        return LedgerSnapshot(
            issued=counts.get(LEDGER_ISSUED, 0),
            eval_issued=counts.get(LEDGER_EVAL_ISSUED, 0),
            **{name: counts.get(name, 0) for name in LEDGER_OUTCOMES},
            in_flight=sum(int(n) for n in lengths),
            damaged=damaged,
        )

    def depths(self) -> dict[str, int]:
        with self.redis.pipeline(transaction=False) as pipe:
            for stage in self.keys.stages:
                pipe.xlen(stage.stream)
            lengths = pipe.execute()
        return {stage.group: int(n) for stage, n in zip(self.keys.stages, lengths, strict=True)}

    def incr(self, counter: str, amount: int = 1) -> None:
        """Add to a `Counter` (or `restarts_counter(service)`). A counter holding garbage (not
        written by us) starts again from `amount` rather than failing the caller."""
        try:
            self.write("HINCRBY", self.keys.counters, str(counter), amount)
        except redis.ResponseError as exc:
            if "not an integer" not in str(exc):
                raise
            log.warning("counter %s held a non-integer value; restarting it at %d", counter, amount)
            self.write("HSET", self.keys.counters, str(counter), amount)

    def counters(self) -> dict[str, int]:
        """Every counter; a value that is not an integer is skipped."""
        out = {}
        raw: Any = self._read({}, self.redis.hgetall, self.keys.counters)
        for k, v in raw.items():
            try:
                out[k.decode()] = int(v)
            except ValueError:
                log.warning("counter %r holds %r, not an integer; skipped", k, v)
        return out

    def pass_rate(self, filtered: int | None = None) -> float | None:
        """The run's gatekeeper pass rate so far (`filtered` from a ledger snapshot, if at hand)."""
        if filtered is None:
            filtered = self.ledger().filtered
        raw: Any = self._read(None, self.redis.hget, self.keys.counters, Counter.GATEKEEPER_KEPT)
        kept = 0 if raw is None else self._int_at(self.keys.counters, raw, None)
        return None if kept is None else pass_rate(kept, filtered)

    def dead_letter_count(self) -> int:
        return int(self.redis.xlen(self.keys.dead))

    # --- run state: policy version, learner state, run info --------------------------------------
    def policy_version(self) -> int:
        """The newest policy version the learner published (0 before the first)."""
        raw: Any = self._read(None, self.redis.get, self.keys.policy_version)
        return self._int_at(self.keys.policy_version, raw, 0)

    def set_policy_version(self, version: int) -> None:
        self.write("SET", self.keys.policy_version, version)

    def learner_state(self) -> dict[str, str]:
        """`state`, `step`, `policy_version`, `at` as learner rank 0 last wrote them."""
        raw: Any = self._read({}, self.redis.hgetall, self.keys.learner_state)
        return _strings(raw)

    def set_learner_state(self, state: str, *, step: int, policy_version: int) -> None:
        mapping = {
            "state": state,
            "step": step,
            "policy_version": policy_version,
            "at": time.time(),
        }
        self.write("HSET", self.keys.learner_state, *(x for kv in mapping.items() for x in kv))

    def run_info(self) -> dict[str, str]:
        """The run-info hash (`RunField` names) as strings."""
        raw: Any = self._read({}, self.redis.hgetall, self.keys.run_info)
        return _strings(raw)

    def run_field(self, field: RunField) -> str | None:
        raw: Any = self._read(None, self.redis.hget, self.keys.run_info, field)
        return None if raw is None else raw.decode("utf-8", "replace")

    def run_int(self, field: RunField, default: int = 0) -> int:
        """An integer run-info field (`default` when absent or not an integer: counted)."""
        return self._int_at(
            self.keys.run_info,
            self._read(None, self.redis.hget, self.keys.run_info, field),
            default,
        )

    def update_run_info(self, fields: Mapping[RunField, str | int | float]) -> None:
        self.write("HSET", self.keys.run_info, *(x for k, v in fields.items() for x in (str(k), v)))

    def clear_run_field(self, field: RunField) -> None:
        self.write("HDEL", self.keys.run_info, str(field))

    def eval_history(self) -> list[tuple[int, float, float]]:
        """[(step, accuracy, RL seconds)] of every evaluation so far (RL seconds, -1 if unknown:
        when the evaluated weights existed, counted from the first training step); malformed history
        reads as empty."""
        try:
            rows = json.loads(self.run_field(RunField.EVAL_HISTORY) or "[]")
            return [
                (int(row[0]), float(row[1]), float(row[2]) if len(row) > 2 else -1.0)
                for row in rows
            ]
        except (ValueError, TypeError):
            log.warning("run info eval_history is malformed; treated as empty")
            return []

    def mark_trained_id(self, group_id: str) -> bool:
        """Record a trained group id; False when it was trained before."""
        return bool(self.write("SADD", self.keys.trained_ids, group_id))

    # --- operator requests --------------------------------------------------------------------
    def post_control(self, request: ControlRequest) -> None:
        request.at = time.time()
        self.redis.hset(self.keys.control, request.kind, request.model_dump_json())

    def control_requests(self) -> dict[str, ControlRequest]:
        """Pending operator requests by kind. One that does not parse is removed and counted."""
        out: dict[str, ControlRequest] = {}
        requests: Any = self._read(None, self.redis.hgetall, self.keys.control)
        if requests is None:  # not a hash: no request can be read from it, nor posted to it
            self.write(
                "HDEL", self.keys.control, "-"
            )  # a no-op HDEL replaces it (write's wrong-type rule)
            return out
        for field, raw in requests.items():
            kind = field.decode("utf-8", "replace")
            try:
                request = _CONTROL.validate_json(raw)
                if request.kind != kind:
                    raise ValueError(f"stored under {kind!r} but is a {request.kind!r} request")
            except (ValidationError, ValueError) as exc:
                log.error("control request %r is malformed (%s); dropped", kind, exc)
                self.redis.hdel(self.keys.control, field)
                self.incr(Counter.BAD_CONTROL_REQUESTS)
                continue
            out[kind] = request
        return out

    def clear_control(self, kind: str) -> None:
        self.write("HDEL", self.keys.control, kind)

    # --- metrics history ----------------------------------------------------------------------
    def append_metrics(self, record: Mapping[str, Any]) -> None:
        self.write(
            "XADD", self.keys.metrics, "MAXLEN", "~", METRICS_MAXLEN, "*", "m", json.dumps(record)
        )

    def recent_metrics(self, count: int | None = None) -> list[dict[str, Any]]:
        """The last `count` per-step records (all when None), oldest first; a record that is not
        a JSON object with an integer `step` is skipped (not counted: readers poll this often)."""
        newest_first: Any = (
            None if count is None else self.redis.xrevrange(self.keys.metrics, count=count)
        )
        rows: Any = (
            self.redis.xrange(self.keys.metrics) if newest_first is None else newest_first[::-1]
        )
        out = []
        for _, fields in rows:
            try:
                record = json.loads(fields[b"m"])
            except (KeyError, ValueError):
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record)
        return out

    def last_metrics(self) -> dict[str, Any]:
        recent = self.recent_metrics(1)
        return recent[-1] if recent else {}

    # --- service instances: heartbeats and final stats ---------------------------------------
    def live_instances(self, kind: str = "*") -> list[dict[str, Any]]:
        """Status of every instance whose heartbeat has not expired, with `age_s` added.

        A heartbeat that is not a JSON object with a string `id`, a numeric `at` and (when
        present) an integer `policy_version` is skipped and counted (`bad_redis_values`): one
        garbage value must not take down the readers (the API, the learner's weight sync)."""
        now = time.time()
        out = []
        for key in self.redis.scan_iter(match=self.keys.heartbeat_pattern(kind), count=200):
            raw = self._read(None, self.redis.get, key)
            if raw is None:  # expired between the scan and the read (or not a string)
                continue
            try:
                info = json.loads(raw)
                if not isinstance(info, dict) or not isinstance(info.get("id"), str):
                    raise ValueError("not a JSON object with a string id")
                info["age_s"] = round(now - float(info.get("at", now)), 3)
                if "policy_version" in info:
                    info["policy_version"] = int(info["policy_version"])
            except (ValueError, TypeError, OverflowError) as exc:
                self.skip_bad_value(key, exc, raw)
                continue
            out.append(info)
        return sorted(out, key=lambda i: (str(i.get("kind", "")), str(i.get("id", ""))))

    def skip_bad_value(self, key: Any, problem: object, raw: bytes | str = b"") -> None:
        """Log and count a value read from Redis that does not parse; the reader skips it.

        Each (key, value) is logged and counted once per process: readers poll (the API every
        few seconds, the learner every step), and one planted value must not read as thousands."""
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        if (name, raw) in self._bad_seen:
            return
        if len(self._bad_seen) >= BAD_VALUES_REMEMBERED:
            self._bad_seen.clear()
        self._bad_seen.add((name, raw))
        log.warning("skipping a malformed value in Redis at %s: %s", name, problem)
        with contextlib.suppress(
            redis.RedisError, FencedError
        ):  # a count is not worth failing the reader
            self.incr(Counter.BAD_REDIS_VALUES)

    def drop_heartbeat(self, kind: str, instance_id: str) -> None:
        """Declare an instance gone before its heartbeat expires (the supervisor saw it die)."""
        self.redis.delete(self.keys.heartbeat(kind, instance_id))

    def write_final_stats(self, kind: str, instance_id: str, stats: Mapping[str, Any]) -> None:
        """What the run summary reports about an instance after it is gone."""
        self.redis.hset(
            self.keys.final_stats(kind, instance_id),
            mapping={k: json.dumps(v) for k, v in stats.items()},
        )

    def final_stats(self, kind: str) -> dict[str, dict[str, Any]]:
        """Final stats of every instance of `kind` that wrote them, by instance id."""
        out = {}
        for key in self.redis.scan_iter(match=self.keys.final_stats_pattern(kind)):
            stats: Any = self._read(None, self.redis.hgetall, key)
            if not stats:  # expired since the scan, or not a hash
                continue
            try:
                out[key.decode().rsplit(":", 1)[-1]] = {
                    k.decode(): json.loads(v) for k, v in stats.items()
                }
            except ValueError:
                continue
        return out

    # --- the server ---------------------------------------------------------------------------
    def clear_namespace(self) -> None:
        """Delete every key of this run's namespace (a fresh run)."""
        for key in self.redis.scan_iter(match=f"{self.keys.ns}:*", count=1000):
            self.redis.delete(key)

    def check_memory_policy(self) -> None:
        check_memory_policy(self.redis)

    def memory_report(self) -> dict[str, Any]:
        return memory_report(self.redis)

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def close(self) -> None:
        self.redis.close()


def _strings(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}


def _text(name: bytes | str) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


def _entry_id(pending: Any) -> str:
    eid = pending["message_id"]
    return str(eid.decode() if isinstance(eid, bytes) else eid)


def is_evaluation(fields: Fields) -> bool:
    """An evaluation job, group or result, read from its fields without decoding it whole (it
    dies in the evaluation lane of the ledger; the drain leaves it to run)."""
    if fields.get(b"kind") == b"eval":
        return True
    try:
        meta = json.loads(fields[b"meta"])
        return bool(meta.get("eval") or meta.get("job", {}).get("eval"))
    except (KeyError, ValueError, AttributeError, TypeError):
        return False


def _group_id_from_meta(fields: Fields) -> bytes | None:
    try:
        meta = json.loads(fields[b"meta"])
        group_id = meta.get("group_id") or meta.get("job", {}).get("group_id")
        return str(group_id).encode() if group_id else None
    except (KeyError, ValueError, AttributeError, TypeError):
        return None
