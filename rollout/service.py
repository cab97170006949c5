"""`dapo rollout`: one rollout replica.

Loop: between generation batches, apply any weight broadcast addressed to this replica; take up
to `rollout.prompts_per_batch` prompt jobs; make sure the weights held are at least as new as
each job's `issued_version` (waiting for the learner's catch-up broadcast if not); generate
`group_size` responses per job with behaviour log-probs; forward each group to the rollouts
stream with one atomic hop. The heartbeat reports the policy version held and the idle fraction.
On SIGTERM the current batch finishes (a batch is short), unstarted jobs are handed back, and the
process exits.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from rollout.engine import Engine, make_engine
from services.contracts.bus import Entry, StreamBus, is_oom
from services.contracts.config import DapoConfig
from services.contracts.faults import stretch
from services.contracts.keys import Counter
from services.contracts.runtime import Heartbeat, StopFlag, service_context
from services.contracts.schemas import (
    PromptJob,
    Response,
    RolloutGroup,
    SchemaError,
    decode_job,
    encode_group,
)
from services.contracts.weight_sync import Announcement

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, cfg: DapoConfig, bus: StreamBus, engine: Engine, replica_id: str, stop: StopFlag) -> None:
        self.cfg, self.bus, self.engine, self.id, self.stop = cfg, bus, engine, replica_id, stop
        self.policy_version = 0
        self.weights_cursor = "$"
        self.groups_done = 0
        self.busy_s = 0.0
        self.sync_s = 0.0
        self.started = time.monotonic()
        self.hb: Heartbeat | None = None
        self.group_key = ""  # the broadcast group this replica last received over
        # Wall-clock time of the newest weights held: when their broadcast was announced, or when
        # they were loaded from the store. A late-completing old broadcast does not look recent.
        self.weights_from = time.time()

    # --- weights ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        wall = max(time.monotonic() - self.started, 1e-9)
        return {
            "policy_version": self.policy_version,
            "groups": self.groups_done,
            "idle_fraction": round(1.0 - (self.busy_s + self.sync_s) / wall, 4),
            "sync_seconds": round(self.sync_s, 3),
        }

    def poll_weights(self, block_ms: int | None = None) -> None:
        """Apply every pending announcement that names this replica (newest wins)."""
        reply = self.bus.redis.xread({self.bus.keys.weights: self.weights_cursor}, count=64, block=block_ms)
        if self.weights_cursor == "$":
            # First call: start after the newest announcement; the learner's catch-up sync includes
            # this replica once its heartbeat is seen.
            last = self.bus.redis.xrevrange(self.bus.keys.weights, count=1)
            self.weights_cursor = last[0][0].decode() if last else "0"
        newest: Announcement | None = None
        newest_at = 0.0
        for _, entries in reply or []:
            for eid, fields in entries:
                self.weights_cursor = eid.decode()
                ann = Announcement.from_json(json.loads(fields[b"ann"]))
                announced_at = int(self.weights_cursor.split("-")[0]) / 1000
                # Only the newest announcement naming this replica matters, and only while its
                # rendezvous can still be open: joining an abandoned one would just time out.
                if self.id in ann.members and time.time() - announced_at < ann.timeout_s / 2:
                    newest, newest_at = ann, announced_at
        if newest is not None:
            self._apply(newest, newest_at)

    def _await_go(self, ann: Announcement) -> bool:
        """Phase one of a sync: register, then wait for the learner's go/abort."""
        keys, r = self.bus.keys, self.bus.redis
        r.sadd(keys.weight_join(ann.group_key), self.id)
        r.expire(keys.weight_join(ann.group_key), int(ann.timeout_s * 4) + 60)
        deadline = time.monotonic() + ann.timeout_s
        while time.monotonic() < deadline and not self.stop.stopping:
            decision = r.get(keys.weight_decision(ann.group_key))
            if decision is not None:
                return decision == b"go"
            time.sleep(0.02)
        return False

    def _apply(self, ann: Announcement, announced_at: float) -> None:
        start = time.monotonic()
        if not self.engine_has_group(ann) and not self._await_go(ann):
            log.info("weight sync %s aborted; waiting for the next", ann.group_key)
            return
        try:
            self.engine.receive_weights(ann, ann.members.index(self.id) + 1)
        except Exception:
            log.exception("weight broadcast %d (%s) failed", ann.version, ann.group_key)
            self.group_key = ""
            if not getattr(self.engine, "weights_consistent_after_failure", False):
                self.load_published()  # half old, half new: never generate with such weights
            return
        finally:
            self.sync_s += time.monotonic() - start
        self.group_key = ann.group_key
        self.weights_from = announced_at
        if ann.version < self.policy_version:  # must never happen: the learner numbers upwards
            self.bus.incr(Counter.REPLICA_VERSION_REGRESSIONS)
            log.error("received version %d while holding %d", ann.version, self.policy_version)
        self.policy_version = ann.version
        self.heartbeat_now()

    def engine_has_group(self, ann: Announcement) -> bool:
        """True when this replica already belongs to the announced group (no join needed)."""
        return self.group_key == ann.group_key

    def load_published(self) -> None:
        """Load the newest committed checkpoint (or the base model): after a failed broadcast,
        and at start, so a late joiner begins from recent weights. The learner's catch-up sync
        brings the replica the rest of the way."""
        from services.contracts.checkpoint_store import latest_checkpoint

        latest = latest_checkpoint(self.cfg.checkpoint_dir)
        held = self.policy_version
        if latest is not None and (latest.path / "hf").is_dir():
            self.engine.load_weights_from_dir(str(latest.path / "hf"))
            self.policy_version = int(latest.meta.get("policy_version", 0))
        else:
            self.engine.load_weights_from_dir(self.cfg.model.path)
            self.policy_version = 0
        if self.policy_version < held:
            self.bus.incr(Counter.REPLICA_VERSION_REGRESSIONS)
            log.warning("fell back from version %d to the published version %d", held, self.policy_version)
        self.weights_from = time.time()
        log.info("loaded published weights: policy version %d", self.policy_version)
        self.heartbeat_now()

    def catch_up_from_store(self) -> bool:
        """A replica that lost contact (no weights for longer than a broadcast may take: it was
        hung, partitioned, or its syncs failed) and is too far behind to produce usable samples
        first loads the newest committed checkpoint when that is newer than what it holds: a
        local read instead of a broadcast. The learner's catch-up sync then brings it the rest of
        the way. A replica in a working group never does this. Returns True when it loaded."""
        from services.contracts.checkpoint_store import latest_checkpoint

        if time.time() - self.weights_from < self.cfg.learner.collective_timeout_s:
            return False
        published = self.bus.policy_version()
        if published - self.policy_version <= self.cfg.algorithm.max_staleness:
            return False
        latest = latest_checkpoint(self.cfg.checkpoint_dir)
        if latest is None or not (latest.path / "hf").is_dir() or int(latest.meta.get("policy_version", 0)) <= self.policy_version:
            return False
        log.warning("holding version %d while the learner is at %d: loading checkpoint step %d",
                    self.policy_version, published, latest.step)
        try:
            self.load_published()
        except (OSError, RuntimeError, ValueError):  # retention removed it meanwhile, a bad file...
            log.exception("could not load checkpoint step %d; waiting for the learner's sync", latest.step)
            self.weights_from = time.time()  # don't retry at once
            return False
        self.bus.incr(Counter.REPLICA_STORE_CATCH_UPS)
        return True

    def heartbeat_now(self) -> None:
        if self.hb is not None:
            self.hb.beat()

    def wait_for_version(self, version: int) -> bool:
        """Block (receiving broadcasts) until the weights held are at least `version`."""
        while self.policy_version < version and not self.stop.stopping:
            self.poll_weights(block_ms=500)
        return self.policy_version >= version

    # --- work ------------------------------------------------------------------------------
    def handle(self, entries: list[Entry]) -> None:
        stage = self.bus.keys.prompts
        jobs: list[tuple[str, PromptJob]] = []
        for entry_id, fields in entries:
            try:
                jobs.append((entry_id, decode_job(fields)))
            except SchemaError as exc:
                self.bus.dead_letter(stage, entry_id, fields, f"rollout: {exc}")
        if not jobs:
            return
        need = max(job.issued_version for _, job in jobs)
        if not self.wait_for_version(need):  # stopping: give the work back untouched
            for entry_id, fields in entries:
                self.bus.hand_back(stage, entry_id, fields)
            return
        ro = self.cfg.rollout
        start = time.monotonic()
        outputs = self.engine.generate(
            [job.prompt_ids for _, job in jobs], n=ro.group_size, max_tokens=ro.max_response_len,
            temperature=ro.temperature, top_p=ro.top_p,
        )
        stretch("rollout.slowdown", time.monotonic() - start, self.stop.event)  # fault suite only
        seconds = time.monotonic() - start
        self.busy_s += seconds
        for (entry_id, job), samples in zip(jobs, outputs, strict=True):
            group = RolloutGroup(
                job=job, policy_version=self.policy_version, replica_id=self.id, gen_seconds=seconds / len(jobs),
                responses=[Response(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason) for s in samples],  # type: ignore[arg-type]
            )
            self.groups_done += self.bus.hop(stage, entry_id, downstream=self.bus.keys.rollouts.stream, fields=encode_group(group))

    def run(self) -> None:
        from services.contracts.checkpoint_store import latest_checkpoint

        if latest_checkpoint(self.cfg.checkpoint_dir) is not None:
            self.load_published()
        self.poll_weights()
        last_maintenance = 0.0
        q = self.cfg.queue
        while not self.stop.stopping:
            try:
                maintenance = time.monotonic() - last_maintenance > 5.0
                if maintenance:
                    self.catch_up_from_store()  # before taking a broadcast: the store is the cheap part
                self.poll_weights()
                entries: list[Entry] = []
                if maintenance:
                    last_maintenance = time.monotonic()
                    entries = self.bus.reclaim(self.bus.keys.prompts, min_idle_s=q.claim_idle_s, max_deliveries=q.max_deliveries)
                if not entries:
                    entries = self.bus.read(self.bus.keys.prompts, count=self.cfg.rollout.prompts_per_batch, block_ms=200)
                if entries:
                    self.handle(entries)
            except redis.ConnectionError as exc:  # ride out a Redis restart; pending work is reclaimed
                log.warning("redis unavailable (%s); retrying", exc)
                self.stop.wait(1.0)
            except redis.ResponseError as exc:
                if self.stop.stopping and is_oom(exc):  # asked to stop while paused on a full Redis
                    break
                raise


def main(cfg: DapoConfig) -> int:
    ctx = service_context(cfg, "rollout")
    log.info("loading %s engine from %s", cfg.rollout.engine, cfg.model.path)
    engine = make_engine(cfg)
    worker = RolloutWorker(cfg, ctx.bus, engine, ctx.inst, ctx.stop)
    worker.hb = ctx.heartbeat(cfg.queue.heartbeat_ttl_s, worker.status)
    log.info("rollout replica %s ready", ctx.inst)
    try:
        worker.run()
    finally:
        ctx.write_final_stats(worker.status())
        worker.hb.stop()
        engine.close()
    log.info("rollout replica %s stopped after %d groups", ctx.inst, worker.groups_done)
    return 0
