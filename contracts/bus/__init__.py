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

The bus is split by concern, all behind the same fenced writes (`core`):

- `transport`: issue, read, claim, hop, hand back, dead-letter, and the ledger;
- `run_state`: policy version, learner state, run info, eval history, control requests;
- `telemetry`: counters, metrics history, heartbeats, final stats;
- `prompt_history`: how each training prompt's groups fared (for skipping prompts);
- `hygiene`: what to do with values in Redis this system did not write;
- `scripts`: the Lua scripts, `library`: the same as a Redis function library and how a client
  calls it; `connection`: the client and the server's memory policy.

`StreamBus` is all of them in one object: a process opens one (`open_bus`) and its factory
hands each stage only the concerns it uses, typed by concern (`RolloutReplica(transport=bus,
run_state=bus)`), so a constructor says what it touches and mypy refuses a stage a method of a
concern it was not given. Only the application (the launcher, the API, `dapo status`) and a
process's own assembly (`ServiceContext`, the learner's `rank0_collaborators`) hold the whole
bus. What every concern shares (the core: counters through `incr`, the consumer groups, the
fence) is reachable from each, so the types tell the concerns apart, not the core.
"""

from __future__ import annotations

import threading

from contracts.bus.connection import (
    OOM_PAUSE_COUNTER,
    PausingRedis,
    check_memory_policy,
    connect,
    is_oom,
    memory_report,
)
from contracts.bus.core import Entry, FencedError, Fields
from contracts.bus.prompt_history import MAX_PROMPTS, PromptHistory, PromptStats
from contracts.bus.run_state import RunState
from contracts.bus.telemetry import METRICS_MAXLEN, Telemetry
from contracts.bus.transport import (
    DEAD_LETTER_MAXLEN,
    GONE_AFTER_TTLS,
    OWN_IDLE_MS,
    LedgerSnapshot,
    Transport,
    pass_rate,
)
from contracts.keys import Keys


class StreamBus(Transport, RunState, Telemetry, PromptHistory):
    """The pipeline's streams and run state for one namespace, as seen by one consumer.

    The only way into Redis: the stages and the application use these methods; `redis` (the
    raw client) is for the other contracts modules (heartbeats, the weight-sync channel) only.
    """


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


__all__ = [
    "DEAD_LETTER_MAXLEN",
    "GONE_AFTER_TTLS",
    "MAX_PROMPTS",
    "METRICS_MAXLEN",
    "OOM_PAUSE_COUNTER",
    "OWN_IDLE_MS",
    "Entry",
    "FencedError",
    "Fields",
    "LedgerSnapshot",
    "PausingRedis",
    "PromptHistory",
    "PromptStats",
    "RunState",
    "StreamBus",
    "Telemetry",
    "Transport",
    "check_memory_policy",
    "connect",
    "is_oom",
    "memory_report",
    "open_bus",
    "pass_rate",
]
