"""Publishing weights to rollout replicas (learner side of services/contracts/weight_sync.py).

After each step every learner rank takes part in gathering full parameters bucket by bucket
(FSDP2 `full_tensor`, a collective); rank 0 keeps the flattened buckets of the newest version in
host memory and broadcasts them over the side group to the live replicas. Keeping the last
version lets rank 0 *catch up* a replica that missed a broadcast or joined late without asking
the other ranks, while it waits for data.

A sync is two-phase so one dead or hung replica cannot stall everyone: the learner announces the
group, each member registers in a Redis join set before touching torch.distributed, and only
when every member has joined (within `join_timeout_s`) does the learner say `go`; otherwise it
says `abort`, sets the silent members aside for `quarantine_s` (their heartbeat may not have
expired yet; one that reloads weights from the checkpoint store comes back earlier), and
re-forms the group from those that answered.

What this does NOT guarantee: a member that joins and then dies mid-broadcast makes that
broadcast fail after `learner.collective_timeout_s`; the learner never blocks longer than that,
and the survivors are caught up at the next sync.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from services.contracts.bus import StreamBus
from services.contracts.keys import Counter
from services.contracts.weight_sync import (
    Announcement,
    ParamSpec,
    broadcast_bucket,
    make_group_on_store,
    plan_buckets,
)

log = logging.getLogger(__name__)


class WeightPublisher:
    """Rank 0's store, membership generations and the last published weights."""

    def __init__(self, bus: StreamBus, *, host: str, port: int, backend: str, timeout_s: float, bucket_mb: int) -> None:
        self.bus, self.host, self.backend = bus, host, backend
        self.timeout_s, self.bucket_mb = timeout_s, bucket_mb
        self.store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.port = self.store.port
        self.generation = 0
        self.members: tuple[str, ...] = ()
        self.group: dist.ProcessGroup | None = None
        self.version = -1
        self.buckets: tuple[tuple[ParamSpec, ...], ...] = ()
        self.flat: list[torch.Tensor] = []
        self.last_sent: dict[str, float] = {}
        self.failures = 0
        self.last_sync_s = 0.0
        self.join_timeout_s = min(timeout_s, 15.0)
        self.quarantine_s = 30.0
        # id -> (until, the policy version its heartbeat showed when set aside); see replica_versions
        self.quarantined: dict[str, tuple[float, int]] = {}

    def stage(self, version: int, named: Iterable[tuple[str, torch.Tensor]], layout: list[tuple[str, torch.Tensor]]) -> None:
        """Take a new version's full parameters (consumes `named`, which may be a collective)."""
        if not self.buckets:
            self.buckets = plan_buckets(layout, self.bucket_mb)
        tensors = dict(named)
        self.flat = [torch.cat([tensors[p.name].reshape(-1).cpu() for p in bucket]) for bucket in self.buckets]
        self.version = version

    def replica_versions(self) -> dict[str, int]:
        """Policy version of every live, responsive replica.

        A replica set aside for not answering comes back when its quarantine ends, or earlier
        when its heartbeat shows it loaded other weights (a woken replica that reloaded from the
        checkpoint store); one that is merely slow, or whose heartbeat thread lives on while its
        loop is stuck, waits out the quarantine.
        """
        now = time.monotonic()
        out = {}
        for info in self.bus.live_instances("rollout"):
            rid = info["id"]
            version = int(info.get("policy_version", -1))
            if rid in self.quarantined:
                until, seen = self.quarantined[rid]
                if now < until and version == seen:
                    continue
                del self.quarantined[rid]
            out[rid] = version
        return out

    def _set_aside(self, members: Iterable[str]) -> None:
        versions = self.replica_versions()
        for m in members:
            self.quarantined[m] = (time.monotonic() + self.quarantine_s, versions.get(m, -1))

    def _await_joins(self, ann: Announcement) -> set[str]:
        key, deadline = self.bus.keys.weight_join(ann.group_key), time.monotonic() + self.join_timeout_s
        while True:
            joined = {m.decode() for m in self.bus.redis.smembers(key)}
            if joined >= set(ann.members) or time.monotonic() > deadline:
                return joined & set(ann.members)
            time.sleep(0.02)

    def _decide(self, ann: Announcement, decision: str) -> None:
        self.bus.redis.set(self.bus.keys.weight_decision(ann.group_key), decision, ex=int(self.timeout_s * 4) + 60)

    def publish(self, members: Iterable[str] | None = None) -> bool:
        """Broadcast the staged version to `members` (default: every live replica)."""
        chosen = tuple(sorted(members if members is not None else self.replica_versions()))
        if not chosen or self.version < 0:
            return True
        if chosen != self.members or self.group is None:
            self.generation += 1
            self.members, self.group = chosen, None
        ann = Announcement(
            version=self.version, generation=self.generation, members=self.members, store_host=self.host,
            store_port=self.port, backend=self.backend, timeout_s=self.timeout_s, buckets=self.buckets,
        )
        start = time.monotonic()
        if self.group is None:  # a new group: two-phase join first
            self.bus.redis.xadd(self.bus.keys.weights, {"ann": json.dumps(ann.to_json())}, maxlen=1000, approximate=True)
            joined = self._await_joins(ann)
            if joined != set(chosen):
                self._decide(ann, "abort")
                silent = set(chosen) - joined
                self._set_aside(silent)
                self.bus.incr(Counter.WEIGHT_SYNC_DROPPED_REPLICAS, len(silent))
                log.warning("replicas %s did not join weight sync %s; re-forming without them", sorted(silent), ann.group_key)
                self.members = ()
                return self.publish(joined) if joined else False
            self._decide(ann, "go")
        else:  # same members as the last sync: the group exists, just announce the version
            self.bus.redis.xadd(self.bus.keys.weights, {"ann": json.dumps(ann.to_json())}, maxlen=1000, approximate=True)
        try:
            if self.group is None:
                self.group = make_group_on_store(self.store, ann, 0)
            for flat in self.flat:  # host copies; NCCL needs each bucket on the GPU
                broadcast_bucket(self.group, flat.cuda() if self.backend == "nccl" else flat, self.timeout_s)
        except Exception as exc:  # a member died or hung: drop the group, retry later
            self.failures += 1
            self.group, self.members = None, ()
            self.bus.incr(Counter.WEIGHT_SYNC_FAILURES)
            log.warning("weight broadcast of version %d to %s failed: %s", self.version, list(chosen), exc)
            return False
        self.last_sync_s = time.monotonic() - start
        now = time.monotonic()
        for m in chosen:
            self.last_sent[m] = now
        log.info("published version %d to %d replicas in %.3fs", self.version, len(chosen), self.last_sync_s)
        return True

    def catch_up(self, retry_after_s: float = 5.0) -> None:
        """Send the newest version to live replicas that hold an older one."""
        now = time.monotonic()
        behind = [
            rid for rid, v in self.replica_versions().items()
            if v < self.version and now - self.last_sent.get(rid, 0.0) > retry_after_s
        ]
        if behind:
            log.info("catching up %s to version %d", behind, self.version)
            self.publish(behind)
