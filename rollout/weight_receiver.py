"""Receiving weights on a rollout replica: the replica's half of weight sync.

`WeightReceiver` owns everything a replica does about its weights, so the rollout loop only
calls `sync()` between batches, `wait_for(version)` before generating for a job, and hands the
engine `between_steps` to call between decode steps (in-flight updates: a broadcast is taken
while the replica generates, not after its batch):

- reads the weights stream (announcements by learner rank 0, `publisher.WeightPublisher`) and
  acts on the newest one naming this replica that the learner signed and that asks for nothing
  this replica's own model does not have (`_check`): any other entry is skipped, logged and
  counted (`bad_redis_values`), and the replica goes on generating;
- takes part in the two-phase join (docs/security.md, "What a run survives"): registers in the join
  set, then waits for the learner's `go` before touching torch.distributed, so a sync the
  learner aborted costs nothing but the wait;
- hands the engine a `WeightStream` (the engine receives and applies it), or, for an engine
  that takes host tensors (`receives_on_host`), receives in its watcher thread into host
  buffers while the engine keeps generating and hands the engine the received tensors at its
  next decode step: the learner's broadcast then waits for nobody's decode step;
- after a failed broadcast, falls back to the newest committed checkpoint (an engine that may
  hold half old, half new weights must not generate);
- catches up from the checkpoint store after losing contact (a local read instead of a
  broadcast), and reports the policy version held (through the heartbeat, `on_change`);
- loads from the store only an `hf/` export that matches its checkpoint's manifest, as the
  learner verifies before it loads: a checkpoint that does not (no manifest, a file changed,
  added, missing or a symlink) is refused, logged with its step and files, counted
  (`replica_refused_checkpoints`), and the next older one that verifies is loaded instead, else
  the base model.

What this does NOT guarantee: that the replica holds the newest version; only that the version
it reports is the one its engine holds. A replica that is not named by any announcement (e.g.
quarantined) waits for the learner's catch-up sync or the store catch-up. Verification does not
cover a file swapped between the check and the load, nor a writer who rewrites the manifest too
(`contracts/checkpoint_store.py`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import redis
import torch

from contracts.bus import RunState
from contracts.checkpoint_store import (
    HF_EXPORT,
    MARKER,
    CheckpointInfo,
    CheckpointRefused,
    describe_problems,
    latest_checkpoint,
    list_checkpoints,
    verify_subtree,
)
from contracts.config import DapoConfig
from contracts.config import LoraConfig as LoraSettings
from contracts.keys import Counter
from contracts.runtime import StopFlag
from contracts.schemas import SMALL_JSON_BYTES, parse_json
from contracts.signing import WeightKey, weights_public_key
from contracts.weight_sync import (
    Announcement,
    WeightChannel,
    WeightStream,
    check_buckets,
)

log = logging.getLogger(__name__)

STORE_CHECK_S = 5.0
"""How often `sync` considers a catch-up from the checkpoint store."""
WATCH_BLOCK_MS = 1000
"""The announcement watcher's blocking read; it also bounds how long it takes to notice a stop."""
STORE_RESCANS = 3
"""Listings of the store tried when checkpoints keep changing under the check (retention)."""


class WeightSink(Protocol):
    """What the subscriber needs of an engine (`rollout.engine.Engine` satisfies it).

    An engine may set `weights_consistent_after_failure = True` when a failed `update_weights`
    leaves its previous weights intact (receive everything, then swap), and
    `receives_on_host = True` when `update_weights` copies from host tensors it may be given
    from anywhere (the subscriber then receives in the background; an engine whose own worker
    receives onto its device, like vLLM's, leaves it False)."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def load_weights_from_dir(self, path: str) -> None: ...


class WeightReceiver:
    """One replica's weights: its cursor over announcements, its join, its policy version."""

    def __init__(
        self,
        run_state: RunState,
        engine: WeightSink,
        replica_id: str,
        *,
        checkpoint_dir: str | Path,
        base_model_path: str,
        lost_contact_s: float,
        max_staleness: int,
        stop: StopFlag,
        on_change: Callable[[], None] | None = None,
        watch_also: tuple[str, ...] = (),
        key: WeightKey,
        expected: dict[str, tuple[int, ...]],
        expected_host: str | None = None,
    ) -> None:
        # The part of the bus a replica's weights touch: the published policy version, and the
        # announcements' channel beside it.
        self.run_state, self.engine, self.replica_id, self.stop = (
            run_state,
            engine,
            replica_id,
            stop,
        )
        self.channel = WeightChannel(run_state, key)
        self.expected = expected
        """What a broadcast must hold: this replica's weights (or adapters), name -> shape."""
        self.expected_host = expected_host
        """The one host an announcement may name (`DAPO_WEIGHTS_HOST`); None: any."""
        self.checkpoint_dir, self.base_model_path = checkpoint_dir, base_model_path
        self.lost_contact_s, self.max_staleness = lost_contact_s, max_staleness
        self.on_change = on_change
        self.policy_version = 0
        self.sync_s = 0.0
        """Seconds spent joining and receiving (the replica's idle-fraction bookkeeping)."""
        self.cursor = "$"
        self.group_key = ""  # the group this replica last received over (no join needed again)
        # Wall-clock time of the newest weights held: when their broadcast was announced, or when
        # they were loaded from the store. A late-completing old broadcast does not look recent.
        self.weights_from = time.time()
        self._store_checked = 0.0
        self._refused: set[tuple[Path, float]] = set()
        """Checkpoints (path, commit time) this replica refused: never hashed or counted again."""
        self.announced = threading.Event()
        """Set by the watcher thread the moment an announcement is appended: `between_steps`
        (and a slowed-down replica's sleep) react to it at once instead of polling Redis."""
        self.watch_also = watch_also
        self.activity = threading.Event()
        """Set by the watcher when anything is appended to the weights stream or `watch_also`
        (the replica's prompt stream): an idle replica sleeps on it."""
        self._watcher: threading.Thread | None = None
        self.background = bool(getattr(engine, "receives_on_host", False))
        """Receive in the watcher thread (see the module docstring); the engine is still only
        touched by the thread that owns it."""
        self._staged: tuple[Announcement, float, list[tuple[str, torch.Tensor]]] | None = None
        self._staging = threading.Lock()
        """Held while the staged tensors are written (the watcher receives) or read (the owner
        applies): they are views of receive buffers that the next receive reuses."""

    @classmethod
    def from_config(
        cls,
        cfg: DapoConfig,
        run_state: RunState,
        engine: WeightSink,
        replica_id: str,
        stop: StopFlag,
        on_change: Callable[[], None] | None = None,
        watch_also: tuple[str, ...] = (),
    ) -> WeightReceiver:
        return cls(
            run_state,
            engine,
            replica_id,
            checkpoint_dir=cfg.checkpoint_dir,
            base_model_path=cfg.model.path,
            lost_contact_s=cfg.learner.collective_timeout_s,
            max_staleness=cfg.algorithm.max_staleness,
            stop=stop,
            on_change=on_change,
            watch_also=watch_also,
            key=weights_public_key(),
            expected=model_param_shapes(
                cfg.model.path, cfg.learner.lora if cfg.learner.lora.enabled else None
            ),
            expected_host=os.environ.get("DAPO_WEIGHTS_HOST") or None,
        )

    # --- the loop's interface ------------------------------------------------------------------
    def start(self) -> None:
        """At start: load the newest committed checkpoint when there is one (a late joiner begins
        from recent weights), and skip announcements made before this replica existed."""
        if latest_checkpoint(self.checkpoint_dir) is not None:
            self.load_published()
        self.poll()
        self._watcher = threading.Thread(target=self._watch, name="weights-watcher", daemon=True)
        self._watcher.start()

    def sync(self) -> None:
        """Between batches: catch up from the store when out of contact, then apply the newest
        pending announcement naming this replica."""
        if time.monotonic() - self._store_checked > STORE_CHECK_S:
            self._store_checked = time.monotonic()
            self.catch_up()  # before taking a broadcast: the store is the cheap part
        self.poll()

    def between_steps(self) -> int:
        """Between two decode steps of a generation: take a broadcast announced (or, receiving in
        the background, received) meanwhile now, so the learner never waits for a batch to end;
        returns the version held from here on. Costs nothing when there is nothing new (one flag
        read)."""
        if self.announced.is_set():
            self.announced.clear()
            self.poll()
        return self.policy_version

    def _watch(self) -> None:
        """Background thread: block on the weights stream (and `watch_also`) and raise
        `announced` / `activity` when something is appended. Receiving in the background, it
        also joins and receives each broadcast naming this replica and raises `announced` once
        the tensors are staged; otherwise it only signals and the receive runs in the thread that
        owns the engine."""
        weights = self.channel.stream
        last = {weights: self.cursor, **{stream: "$" for stream in self.watch_also}}
        while not self.stop.stopping:
            try:
                reply = self.channel.read(last, block_ms=WATCH_BLOCK_MS)
            except redis.RedisError:
                self.stop.wait(1.0)  # Redis restarting: the loop's own polls ride it out
                continue
            if self.stop.stopping:
                return
            for name, entries in reply:
                last[name] = entries[-1][0].decode()
                if name == weights and not self.background:
                    self.announced.set()
                elif name == weights and (newest := self._newest_for_me(entries)) is not None:
                    self._receive_staged(*newest)
                self.activity.set()

    def wait_for(self, version: int) -> bool:
        """Block (receiving broadcasts) until the weights held are at least `version`; False
        when asked to stop first."""
        while self.policy_version < version and not self.stop.stopping:
            if self.background:  # the watcher receives; apply what it staged
                self.announced.wait(0.5)
                self.between_steps()
            else:
                self.poll(block_ms=500)
        return self.policy_version >= version

    # --- announcements ---------------------------------------------------------------------------
    def poll(self, block_ms: int | None = None) -> None:
        """Apply the newest pending announcement that names this replica (older ones are moot);
        receiving in the background, apply the newest staged broadcast instead."""
        if self.cursor == "$":
            # First call: start after the newest announcement; the learner's catch-up sync includes
            # this replica once its heartbeat is seen.
            self.cursor = self.channel.newest_id()
            return
        if self.background:
            self._apply_staged()
            return
        for _, entries in self.channel.read({self.channel.stream: self.cursor}, block_ms=block_ms):
            self.cursor = entries[-1][0].decode()
            newest = self._newest_for_me(entries)
            if newest is not None:
                self._apply(*newest)

    def _newest_for_me(
        self, entries: list[tuple[bytes, dict[bytes, bytes]]]
    ) -> tuple[Announcement, float] | None:
        """The newest announcement in `entries` that names this replica while its rendezvous can
        still be open (joining an abandoned one would just time out)."""
        newest: tuple[Announcement, float] | None = None
        for eid, fields in entries:
            try:
                data: Any = parse_json(
                    self.channel.verified(fields), "announcement", SMALL_JSON_BYTES
                )
                ann = Announcement.from_json(data)
                if self.replica_id in ann.replicas:
                    self._check(ann)
            except (
                KeyError,
                ValueError,
                TypeError,
                AttributeError,
            ) as exc:  # not the learner's, or not for this model: skip it
                log.error("refused weight announcement %s: %s", eid.decode(), exc)
                self.run_state.skip_bad_value(f"{self.run_state.keys.weights} {eid.decode()}", exc)
                continue
            # Fresh by the learner's signed clock (a copy re-added later gets a new stream id,
            # not a new signature), while its rendezvous can still be open.
            announced_at = ann.issued_at
            if self.replica_id in ann.replicas and time.time() - announced_at < ann.timeout_s / 2:
                newest = ann, announced_at
        return newest

    def _check(self, ann: Announcement) -> None:
        """ValueError unless a signed announcement asks only what this replica can give: the
        expected host, and buckets holding exactly its own parameters (before any allocation)."""
        if ann.group_key == self.group_key and ann.policy_version <= self.policy_version:
            raise ValueError(
                f"version {ann.policy_version} over the group this replica holds version "
                f"{self.policy_version} from: a replay"
            )
        if self.expected_host is not None and ann.store_host != self.expected_host:
            raise ValueError(
                f"rendezvous host {ann.store_host!r} is not the learner's "
                f"({self.expected_host!r}, DAPO_WEIGHTS_HOST)"
            )
        check_buckets(ann, self.expected)

    def _await_go(self, ann: Announcement) -> bool:
        """Phase one of a sync: register in the join set, then wait for the learner's go/abort
        (at most ann.timeout_s; an unanswered join counts as abort)."""
        self.channel.join(ann, self.replica_id)
        deadline = time.monotonic() + ann.timeout_s
        while time.monotonic() < deadline and not self.stop.stopping:
            decision = self.channel.decision(ann)
            if decision is not None:
                return decision == b"go"
            time.sleep(0.005)
        return False

    def _joined(self, ann: Announcement) -> bool:
        """In the group `ann` broadcasts over: already, or after a two-phase join."""
        if self.group_key == ann.group_key or self._await_go(ann):
            return True
        log.info("weight sync %s aborted; waiting for the next", ann.group_key)
        return False

    def _receive_staged(self, ann: Announcement, announced_at: float) -> None:
        """Watcher thread, receiving in the background: join, receive every bucket into host
        buffers, and leave them for the owner's next `between_steps`. A broadcast that fails
        part-way stages nothing; the engine's weights were never touched."""
        if not self._joined(ann):
            return
        with self._staging:
            self._staged = None  # the receive overwrites the buffers an unapplied version is in
            try:
                tensors = list(WeightStream(ann, ann.rank_of(self.replica_id)))
            except Exception:
                log.exception("weight broadcast %d (%s) failed", ann.policy_version, ann.group_key)
                self.group_key = ""
                return
            self.group_key = ann.group_key
            self._staged = ann, announced_at, tensors
        self.announced.set()

    def _apply_staged(self) -> None:
        """Owner thread: hand the newest staged broadcast to the engine (a host-to-engine copy)."""
        if self._staged is None or not self._staging.acquire(blocking=False):
            return  # nothing staged, or the watcher is receiving a newer one: next step
        try:
            staged, self._staged = self._staged, None
            # Versions only grow (a restore resumes above the newest published one), so an older
            # staged version lost a race with a store load and is moot.
            if staged is None or staged[0].policy_version < self.policy_version:
                return
            start = time.monotonic()
            ann, announced_at, tensors = staged
            self.engine.update_weights(tensors)
            self.sync_s += time.monotonic() - start
        finally:
            self._staging.release()
        self.weights_from = announced_at
        self._hold(ann.policy_version, "broadcast")

    def _apply(self, ann: Announcement, announced_at: float) -> None:
        start = time.monotonic()
        if not self._joined(ann):
            self.sync_s += time.monotonic() - start
            return
        try:
            self.engine.update_weights(WeightStream(ann, ann.rank_of(self.replica_id)))
        except Exception:
            log.exception("weight broadcast %d (%s) failed", ann.policy_version, ann.group_key)
            self.group_key = ""
            if not getattr(self.engine, "weights_consistent_after_failure", False):
                self.load_published()  # half old, half new: never generate with such weights
            return
        finally:
            self.sync_s += time.monotonic() - start
        self.group_key = ann.group_key
        self.weights_from = announced_at
        self._hold(ann.policy_version, "broadcast")

    def _hold(self, version: int, source: str) -> None:
        if (
            version < self.policy_version
        ):  # a broadcast never does this: the learner numbers upwards
            self.run_state.incr(Counter.REPLICA_VERSION_REGRESSIONS)
            log.warning(
                "%s brought version %d while holding %d", source, version, self.policy_version
            )
        self.policy_version = version
        if self.on_change is not None:
            self.on_change()

    # --- the checkpoint store --------------------------------------------------------------------
    def load_published(self) -> None:
        """Load the newest committed checkpoint whose export verifies (or the base model): after a
        failed broadcast, and at start. The learner's catch-up sync brings the replica the rest of
        the way."""
        self._load_from_store(self._newest_verified(above=-1))

    def catch_up(self) -> bool:
        """Catch up from the checkpoint store after losing contact; True when it loaded.

        A replica that had no weights for longer than a broadcast may take (it was hung,
        partitioned, or its syncs failed) and is more than max_staleness behind the learner loads
        the newest committed checkpoint that verifies, when that is newer than what it holds: a
        local read instead of a broadcast. The learner's catch-up sync then brings it the rest of
        the way. A replica in a working group never does this."""
        if time.time() - self.weights_from < self.lost_contact_s:
            return False
        published = self.run_state.policy_version()
        if published - self.policy_version <= self.max_staleness:
            return False
        latest = latest_checkpoint(self.checkpoint_dir)
        if latest is None or _version(latest) <= self.policy_version:
            return False
        found = self._newest_verified(above=self.policy_version)
        if found is None:  # every newer one refused (each logged once): wait for the learner's sync
            return False
        log.warning(
            "holding version %d while the learner is at %d: loading checkpoint step %d",
            self.policy_version,
            published,
            found.step,
        )
        try:
            self._load_from_store(found)
        except (
            OSError,
            RuntimeError,
            ValueError,
        ):  # retention removed it since the check, the engine failed...
            log.exception(
                "could not load checkpoint step %d; waiting for the learner's sync", found.step
            )
            self.weights_from = time.time()  # don't retry at once
            return False
        self.run_state.incr(Counter.REPLICA_STORE_CATCH_UPS)
        return True

    def _load_from_store(self, checkpoint: CheckpointInfo | None) -> None:
        """Load `checkpoint`'s export (verified by the caller), or the base model when None."""
        if checkpoint is not None:
            self.engine.load_weights_from_dir(str(checkpoint.path / HF_EXPORT))
            version = _version(checkpoint)
        else:
            self.engine.load_weights_from_dir(self.base_model_path)
            version = 0
        self.weights_from = time.time()
        log.info("loaded published weights: policy version %d", version)
        self._hold(version, "the checkpoint store")

    def _newest_verified(self, above: int) -> CheckpointInfo | None:
        """The newest committed checkpoint holding a policy version above `above` whose `hf/`
        export matches its manifest; None when there is none. Each one refused on the way is
        logged (its step and files) and counted, once: it is not hashed again (a step saved again
        is a new checkpoint, with a new commit time).

        Only `hf/` is checked (`verify_subtree`): the manifest's entries below it, and no file there
        that it does not list. A checkpoint without a manifest (written before manifests) is
        refused, as the learner refuses it.

        Cost: every byte of the export accepted, and of each one refused for its contents, is read
        once more before the load. At the SHA-256 rate measured for the learner (about 550 MiB/s a
        thread, `learner/checkpoint.py`) a 64 GB export in 5 GB shards takes about half a minute on
        `checkpoint_store.HASH_THREADS` (4) threads and two minutes on one, more when the disk is
        slower; the heartbeat thread keeps beating meanwhile. That is paid only at start, after a
        failed broadcast and on a store catch-up, all rare: broadcasts never touch the store and
        hash nothing.

        A checkpoint that retention deleted (or a save of the same step replaced) while it was
        being checked is not damage: the store is listed again, up to STORE_RESCANS times, so a
        newer checkpoint saved meanwhile is found rather than an older one or the base model."""
        for rescans_left in reversed(range(STORE_RESCANS)):
            found, changed = self._scan(above, rescan=rescans_left > 0)
            if found is not None or not changed:
                return found
        return None

    def _scan(self, above: int, *, rescan: bool) -> tuple[CheckpointInfo | None, bool]:
        """One pass over the store, newest first: (the first that verifies, whether one listed
        changed under the check). With `rescan`, a change ends the pass (the caller lists the
        store again); without, the pass goes on to older checkpoints."""
        for checkpoint in reversed(list_checkpoints(self.checkpoint_dir)):
            key = (checkpoint.path, checkpoint.committed_at)
            if key in self._refused or _version(checkpoint) <= above:
                continue
            try:
                problems = verify_subtree(checkpoint.path, HF_EXPORT)
            except CheckpointRefused as exc:
                problems = [str(exc)]
            if not problems:
                if (checkpoint.path / HF_EXPORT).is_dir():
                    return checkpoint, False
                continue  # saved without an export (`checkpoint.save_hf` off) and none listed
            if not _still_committed(
                checkpoint
            ):  # retention or a save of the same step replaced it meanwhile
                if rescan:
                    return None, True
                continue
            self._refused.add(key)
            self.run_state.incr(Counter.REPLICA_REFUSED_CHECKPOINTS)
            log.error(
                "refusing to load checkpoint step %d (%s): %s",
                checkpoint.step,
                checkpoint.path,
                describe_problems(problems),
            )
        return None, False


def model_param_shapes(
    model_dir: str, lora: LoraSettings | None = None
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of what a weight sync carries for the model in `model_dir`: every parameter,
    or with LoRA the adapters alone, named as the learner's model names them. Built on the meta
    device from the model's config (no weights are read or allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from contracts.lora import inject_adapters, is_adapter_param

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    if lora is not None:
        model = inject_adapters(model, lora)
    return {
        name: tuple(p.shape)
        for name, p in model.named_parameters()
        if lora is None or is_adapter_param(name)
    }


def _version(checkpoint: CheckpointInfo) -> int:
    return int(checkpoint.meta.get("policy_version", 0))


def _still_committed(checkpoint: CheckpointInfo) -> bool:
    """The checkpoint listed is still the one at its path (not deleted, not replaced)."""
    try:
        return (checkpoint.path / MARKER).stat().st_mtime == checkpoint.committed_at
    except OSError:
        return False
