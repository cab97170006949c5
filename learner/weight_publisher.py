"""Publishing weights to rollout replicas: learner rank 0's half of weight sync.

After each step every learner rank takes part in gathering full parameters (FSDP2
`full_tensor`, a collective); `stage` consumes that iterator on every rank, and on rank 0 copies
each tensor into the host bucket it belongs to as it arrives, so rank 0 holds one host copy of
the weights and never a second one. Keeping the newest version in host memory lets rank 0
*catch up* a replica that missed a broadcast or joined late without asking the other ranks
(`catch_up`), and serves `staged()` to evaluation and the Hugging Face export.

A sync is two-phase so one dead or hung replica cannot stall everyone (docs/security.md, "What a
run survives"): the learner announces the group on the weights stream, each replica registers in a
Redis join set before touching torch.distributed, and only when every replica has joined (within
`join_timeout_s`) does the learner say `go`; otherwise it says `abort`, sets the silent replicas
aside for `quarantine_s` (their heartbeat may not have expired yet; one that reloads weights
from the checkpoint store comes back earlier), and re-forms the group from those that answered.
The replica half is `subscriber.WeightReceiver`.

What this does NOT guarantee: a replica that joins and then dies or hangs mid-broadcast makes
that broadcast fail after `timeout_s` (learner.collective_timeout_s); the learner never blocks
longer than that per bucket, and the survivors are caught up at the next sync. A replica is
never told which version it missed; it learns from the next announcement naming it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from contracts.bus import RunState, Telemetry
from contracts.keys import Counter
from contracts.signing import WeightKey
from contracts.weight_sync import (
    Announcement,
    Bucket,
    WeightChannel,
    bound_store,
    broadcast_bucket,
    empty_bucket,
    make_group_on_store,
    plan_buckets,
    unflatten,
)
from learner.publish import Publication

log = logging.getLogger(__name__)


class WeightPublisher:
    """Rank 0's store, membership epochs and the newest staged weights.

    `version` is the staged policy version: -1 before the first `stage`, and while one is in
    progress or after one failed (the previous host buckets are released first, so that rank 0
    never holds two versions). `last_publication` is what the last `publish()` moved and how
    long it took (the step's `weight_sync/*` metrics; `catch_up` leaves it alone).
    `dtype` (e.g. "bfloat16", the replicas' `model.dtype`) is what is staged and sent: the host
    copy and the broadcast are in the serving dtype, not the fp32 master weights'.
    """

    def __init__(
        self,
        *,
        run_state: RunState,
        telemetry: Telemetry,
        host: str,
        port: int = 0,
        backend: str,
        timeout_s: float,
        bucket_mb: int,
        dtype: str | None = None,
        key: WeightKey,
    ) -> None:
        # The parts of the bus it touches: `run_state`, where announcements and decisions are
        # written (through `channel`, which signs each), and `telemetry` (the live replicas'
        # heartbeats, counters).
        self.telemetry, self.host, self.backend, self.dtype = telemetry, host, backend, dtype
        self.channel = WeightChannel(run_state, key)
        self.timeout_s, self.bucket_mb = timeout_s, bucket_mb
        # Listens on `host` only (the configured weights host), not on every interface.
        self.store, self._listener = bound_store(host, port, timeout_s)
        self.port = self.store.port
        self.token = secrets.token_hex(4)  # tells this learner's groups from a restarted one's
        self.membership_epoch = 0
        self.replicas: tuple[str, ...] = ()
        self.group: dist.ProcessGroup | None = None
        self.policy_version = -1
        self.buckets: tuple[Bucket, ...] = ()
        self.flat: list[torch.Tensor] = []
        self.last_sent: dict[str, float] = {}
        self.failures = 0
        self.last_publication = Publication()
        self.join_timeout_s = min(timeout_s, 15.0)
        self.quarantine_s = 30.0
        # id -> (until, the policy version its heartbeat showed when set aside);
        # see replica_versions
        self.quarantined: dict[str, tuple[float, int]] = {}

    # --- staging -------------------------------------------------------------------------------
    def stage(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]],
        layout: list[tuple[str, torch.Tensor]],
    ) -> None:
        """Take a new version's full parameters, consuming `named` (a collective on all ranks).

        Each tensor is copied into its host bucket as it arrives; a tensor that arrives before
        its bucket is allocated waits in `pending` (only when `named` is not in `layout`
        order). Every name of `layout` must appear in `named`.
        """
        if not self.buckets:
            self.buckets = plan_buckets(layout, self.bucket_mb, dtype=self.dtype)
        self.flat, self.policy_version = (
            [],
            -1,
        )  # release the old version before gathering the new one
        where = {p.name: (i, p) for i, bucket in enumerate(self.buckets) for p in bucket}
        offsets = [_offsets(bucket) for bucket in self.buckets]
        flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        missing = [len(bucket) for bucket in self.buckets]
        for name, tensor in named:
            if name not in where:
                continue
            i, spec = where[name]
            if flats[i] is None:
                flats[i] = empty_bucket(self.buckets[i])
            start = offsets[i][name]
            flats[i][start : start + spec.numel].copy_(tensor.detach().reshape(-1))  # type: ignore[index]
            missing[i] -= 1
        if any(missing):
            lacking = [p.name for i, b in enumerate(self.buckets) if missing[i] for p in b][:3]
            raise ValueError(f"version {version}: the gathered parameters lack {lacking}")
        self.flat = [f for f in flats if f is not None]
        self.policy_version = version

    def staged(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged version's tensors by name: views of the host buckets, read-only by
        convention (writing through them changes what the next broadcast sends)."""
        for flat, bucket in zip(self.flat, self.buckets, strict=True):
            yield from unflatten(flat, bucket)

    # --- membership ----------------------------------------------------------------------------
    def replica_versions(self) -> dict[str, int]:
        """Policy version of every live, responsive replica.

        A replica set aside for not answering comes back when its quarantine ends, or earlier
        when its heartbeat shows it loaded other weights (a woken replica that reloaded from the
        checkpoint store); one that is merely slow, or whose heartbeat thread lives on while its
        loop is stuck, waits out the quarantine.
        """
        now = time.monotonic()
        out = {}
        for info in self.telemetry.live_instances("rollout"):
            rid = info["id"]
            version = int(info.get("policy_version", -1))
            if rid in self.quarantined:
                until, seen = self.quarantined[rid]
                if now < until and version == seen:
                    continue
                del self.quarantined[rid]
            out[rid] = version
        return out

    def _set_aside(self, replicas: Iterable[str]) -> None:
        versions = self.replica_versions()
        for rid in replicas:
            self.quarantined[rid] = (time.monotonic() + self.quarantine_s, versions.get(rid, -1))

    # --- the join protocol (learner half) --------------------------------------------------------
    def _announce(self, ann: Announcement) -> None:
        self.channel.announce(ann)

    def _await_joins(self, ann: Announcement) -> set[str]:
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            joined = self.channel.joined(ann)
            if joined >= set(ann.replicas) or time.monotonic() > deadline:
                return joined & set(ann.replicas)
            time.sleep(0.005)

    def _decide(self, ann: Announcement, decision: str) -> None:
        self.channel.decide(ann, decision, ttl_s=int(self.timeout_s * 4) + 60)

    def _form_group(self, ann: Announcement) -> set[str] | None:
        """Phase one for a new group: announce, wait for joins, say go or abort.

        Returns None on `go`, else the replicas that did join (the silent ones are set aside)."""
        self._announce(ann)
        joined = self._await_joins(ann)
        if joined == set(ann.replicas):
            self._decide(ann, "go")
            return None
        self._decide(ann, "abort")
        silent = set(ann.replicas) - joined
        self._set_aside(silent)
        self.telemetry.incr(Counter.WEIGHT_SYNC_DROPPED_REPLICAS, len(silent))
        log.warning(
            "replicas %s did not join weight sync %s; re-forming without them",
            sorted(silent),
            ann.group_key,
        )
        return joined

    # --- publishing ------------------------------------------------------------------------------
    def publish(self, replicas: Iterable[str] | None = None) -> bool:
        """Broadcast the staged version to `replicas` (default: every live replica) and record
        what it moved in `last_publication`.

        True when every chosen replica that joined received it (or there was nothing to do);
        False when the sync failed or was re-formed without anyone. Blocks at most about
        join_timeout_s plus timeout_s per bucket."""
        start = time.monotonic()
        sent_to = self._sync(replicas)
        self.last_publication = Publication(
            seconds=time.monotonic() - start,
            # one copy of the staged buckets: the full weights, or the adapters alone with LoRA
            nbytes=sum(flat.nbytes for flat in self.flat) if sent_to else 0,
            replicas=len(sent_to or ()),
            failed=sent_to is None,
        )
        return sent_to is not None

    def _sync(self, replicas: Iterable[str] | None) -> tuple[str, ...] | None:
        """`publish` without the record: the replicas that received the staged version (none
        when there was nothing to do), or None when the sync failed or nobody joined."""
        chosen = tuple(sorted(replicas if replicas is not None else self.replica_versions()))
        if not chosen or self.policy_version < 0:
            return ()
        if chosen != self.replicas or self.group is None:
            self.membership_epoch += 1
            self.replicas, self.group = chosen, None
        ann = Announcement(
            policy_version=self.policy_version,
            membership_epoch=self.membership_epoch,
            replicas=self.replicas,
            store_host=self.host,
            store_port=self.port,
            backend=self.backend,
            timeout_s=self.timeout_s,
            buckets=self.buckets,
            publisher=self.token,
            issued_at=time.time(),
        )
        start = time.monotonic()
        if self.group is None:  # a new group: two-phase join first
            joined = self._form_group(ann)
            if joined is not None:
                self.replicas = ()
                return self._sync(joined) if joined else None
        else:  # same replicas as the last sync: the group exists, just announce the version
            self._announce(ann)
        if not self._broadcast(ann):
            return None
        now = time.monotonic()
        for rid in chosen:
            self.last_sent[rid] = now
        log.info(
            "published version %d to %d replicas in %.3fs",
            self.policy_version,
            len(chosen),
            now - start,
        )
        return chosen

    def _broadcast(self, ann: Announcement) -> bool:
        try:
            if self.group is None:
                self.group = make_group_on_store(self.store, ann, 0)
            for flat in self.flat:  # host copies; NCCL needs each bucket on the GPU
                broadcast_bucket(
                    self.group, flat.cuda() if self.backend == "nccl" else flat, self.timeout_s
                )
        except Exception as exc:  # a replica died or hung: drop the group, retry later
            self.failures += 1
            self.group, self.replicas = None, ()
            self.telemetry.incr(Counter.WEIGHT_SYNC_FAILURES)
            log.warning(
                "weight broadcast of version %d to %s failed: %s",
                ann.policy_version,
                list(ann.replicas),
                exc,
            )
            return False
        return True

    def catch_up(self, retry_after_s: float = 5.0) -> None:
        """Send the staged version to live replicas that hold an older one (late joiners,
        replicas that missed a broadcast), at most once per `retry_after_s` per replica."""
        now = time.monotonic()
        behind = [
            rid
            for rid, v in self.replica_versions().items()
            if v < self.policy_version and now - self.last_sent.get(rid, 0.0) > retry_after_s
        ]
        if behind:
            log.info("catching up %s to version %d", behind, self.policy_version)
            # not the step's publication: its `weight_sync/*` metrics stay the step's own
            self._sync(behind)


def _offsets(bucket: Bucket) -> dict[str, int]:
    out, offset = {}, 0
    for p in bucket:
        out[p.name] = offset
        offset += p.numel
    return out
