"""The transport: issuing prompt jobs, reading a stage's stream through its consumer group,
keeping and reclaiming claims, the atomic hop downstream, handing back, dead-lettering, and the
ledger that accounts for every job."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from contracts.bus.core import Entry, Fields
from contracts.bus.hygiene import RedisHygiene
from contracts.keys import (
    LEDGER_DAMAGED,
    LEDGER_DEAD,
    LEDGER_EVAL_DEAD,
    LEDGER_EVAL_ISSUED,
    LEDGER_FIELDS,
    LEDGER_ISSUED,
    LEDGER_OUTCOMES,
    Counter,
    Stage,
)
from contracts.schemas import group_id_of_fields, is_evaluation, job_signed
from contracts.signing import WeightKey

log = logging.getLogger(__name__)


DEAD_LETTER_MAXLEN = 10_000
"""Dead-letter records kept (about; trimmed approximately). Older records are dropped; every
dead letter is still counted in the ledger and the counters."""

OWN_IDLE_MS = 1000
"""A consumer's own pending entry idle this long, while it holds none, is an orphan (reclaim)."""

GONE_AFTER_TTLS = 2
"""A consumer whose heartbeat is absent is gone once its pending entries sat this many heartbeat
TTLs (`reclaim`, `heartbeat_ttl_s`); a consumer whose heartbeat is present keeps its entries
until `queue.claim_idle_s`."""


@dataclass(frozen=True)
class LedgerSnapshot:
    issued: int
    trained: int
    filtered: int
    stale: int
    dead: int
    in_flight: int
    """Entries still in a stage stream (waiting or being processed), both lanes, by XLEN."""
    eval_issued: int = 0
    evaluated: int = 0
    eval_dead: int = 0
    damaged: bool = False
    """The ledger held a planted value (read as 0, skipped and counted): its figures are not the
    run's."""

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


class Transport(RedisHygiene):
    """The stage streams, their consumer groups, and the ledger."""

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
        appended, repair = self._fenced("issue", [self.keys.prompts.stream, self.keys.ledger], argv)
        self._count_repair(self.keys.ledger, repair)
        return int(appended)

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
            self.ensure_groups((stage,))
            return []
        return [(eid.decode(), fields) for _, entries in reply or [] for eid, fields in entries]

    def renew_claims(self, stage: Stage, entry_ids: list[str]) -> int:
        """Mark entries this consumer is still working on as fresh (their idle time restarts),
        so `reclaim` by others only takes a dead consumer's work; returns how many were ours."""
        if not entry_ids:
            return 0
        return int(
            self.scripts.run(
                "renew_claims", [stage.stream], [stage.group, self.consumer, *entry_ids]
            )
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
        done, ledger_repair, counter_repair, downstream_repair = self._fenced("hop", keys, argv)
        self._count_repair(self.keys.ledger, ledger_repair)
        self._count_repair(self.keys.counters, counter_repair)
        if downstream:
            self._count_repair(downstream, downstream_repair)
        return bool(done)

    def hand_back(self, stage: Stage, entry_id: str, fields: Fields) -> bool:
        """Return an unfinished entry to the head of the work queue (used on SIGTERM)."""
        return self.hop(
            stage,
            entry_id,
            downstream=stage.stream,
            fields={k.decode(): v for k, v in fields.items()},
        )

    def dead_letter(
        self,
        stage: Stage,
        entry_id: str,
        fields: Fields,
        reason: str,
        *,
        foreign: bool | None = None,
    ) -> bool:
        """Move an entry to the dead-letter stream with the reason; count it.

        One of the run's own entries counts as `dead` in the ledger (`eval_dead` for an
        evaluation job); anything else (garbage injected into a stream, a job the learner did not
        sign) as `poison` only, so a planted entry does not unbalance the ledger. `foreign` says
        which when the caller knows; else an entry is the run's when it carries a group id and,
        where this process holds the learner's key (`job_key`), a job the learner signed.
        """
        if foreign is None:
            verdict = None if self.job_key is None else job_signed(fields, self.job_key)
            foreign = verdict is False
        group_id = None if foreign else group_id_of_fields(fields)
        dead = LEDGER_EVAL_DEAD if is_evaluation(fields) else LEDGER_DEAD
        record = {
            "stage": stage.stream.encode(),
            "entry_id": entry_id.encode(),
            "reason": reason.encode("utf-8", "replace"),
            "group_id": group_id_of_fields(fields) or b"",
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

    def retire_unsigned(self, key: WeightKey, reason: str) -> int:
        """Dead-letter as the run's own (counted `dead` or `eval_dead`) every entry left in a
        stage stream whose job `key` does not verify, leaving the others to be worked on; how
        many. For `dapo run --resume` under a new learner key, before any service starts: every
        service would otherwise refuse the earlier incarnation's jobs as foreign (poison), and
        the ledger, which counted them issued, would never balance again. It takes every entry
        of every stage, pending or not: call it only while no stage runs."""
        retired = 0
        for stage in self.keys.stages:
            pending: Any = self.redis.xpending_range(
                stage.stream, stage.group, min="-", max="+", count=1_000_000
            )
            ids: list[Any] = [_entry_id(p) for p in pending]
            claimed: Any = (
                self.redis.xclaim(stage.stream, stage.group, self.consumer, 0, ids) if ids else []
            )
            entries = [(eid.decode(), f) for eid, f in claimed if f is not None]
            entries += self.read(stage, count=1_000_000, block_ms=None)
            for entry_id, fields in entries:
                if job_signed(fields, key):
                    self.hand_back(stage, entry_id, fields)
                else:
                    retired += self.dead_letter(stage, entry_id, fields, reason, foreign=False)
        return retired

    def _dead_letter_by_id(self, stage: Stage, entry_id: str, reason: str) -> None:
        got: Any = self.redis.xrange(stage.stream, min=entry_id, max=entry_id, count=1)
        fields = got[0][1] if got else {}
        self.dead_letter(stage, entry_id, fields, reason)

    def ledger(self) -> LedgerSnapshot:
        """One consistent snapshot (a read-only script, so it works at maxmemory too).

        A planted value (a ledger key of another type, a count that is not an integer) is skipped
        and counted, and reads as 0: the services go on, and the next count replaces it. The
        counts it held are lost, so the snapshot is `damaged` (never balanced) from then on, for
        the rest of the run (`LEDGER_DAMAGED`), which the run summary and /status report."""
        kind, flat, *lengths = self.scripts.run(
            "ledger", [self.keys.ledger, *(stage.stream for stage in self.keys.stages)], []
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

    def depths(self, stages: tuple[Stage, ...] | None = None) -> dict[str, int]:
        """Entries waiting or in progress per stage (by consumer group), default every stage."""
        stages = self.keys.stages if stages is None else stages
        with self.redis.pipeline(transaction=False) as pipe:
            for stage in stages:
                pipe.xlen(stage.stream)
            lengths = pipe.execute()
        return {stage.group: int(n) for stage, n in zip(stages, lengths, strict=True)}

    def pass_rate(self, filtered: int | None = None) -> float | None:
        """The run's gatekeeper pass rate so far (`filtered` from a ledger snapshot, if at hand)."""
        if filtered is None:
            filtered = self.ledger().filtered
        raw: Any = self._read(None, self.redis.hget, self.keys.counters, Counter.GATEKEEPER_KEPT)
        kept = 0 if raw is None else self._int_at(self.keys.counters, raw, None)
        return None if kept is None else pass_rate(kept, filtered)

    def dead_letter_count(self) -> int:
        return int(self.redis.xlen(self.keys.dead))


def _text(name: bytes | str) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


def _entry_id(pending: Any) -> str:
    eid = pending["message_id"]
    return str(eid.decode() if isinstance(eid, bytes) else eid)
