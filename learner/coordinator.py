"""Learner rank 0's coordinator: everything in the learner that touches Redis.

It feeds prompts (admission control), collects kept groups, publishes weights, evaluates,
reports metrics, carries out operator requests from the control hash (checkpoint, restore,
pause), and drains the pipeline at the end so every issued job is accounted for.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from learner.broadcast import WeightPublisher
from learner.feeder import PromptFeeder
from learner.tracking import Trackers
from learner.trainer import Trainer
from services.contracts.bus import StreamBus, open_bus
from services.contracts.config import DapoConfig
from services.contracts.data import load_prompts
from services.contracts.keys import LEDGER_STALE, LEDGER_TRAINED, Counter, RunField
from services.contracts.runtime import Heartbeat, StopFlag, instance_id
from services.contracts.schemas import RolloutGroup, SchemaError, decode_group
from services.contracts.weight_sync import unflatten
from services.shell.evaluation import eval_prompts, evaluate

log = logging.getLogger(__name__)


class Coordinator:
    """Rank 0's side: Redis, feeding, collecting, publishing, evaluating, reporting."""

    def __init__(self, cfg: DapoConfig, trainer: Trainer, backend: str, stop: StopFlag) -> None:
        from transformers import AutoTokenizer

        from rollout.hf_engine import HFEngine

        url = cfg.redis_url
        if not url:
            raise SystemExit("dapo learner: no Redis URL (set queue.redis_url or DAPO_REDIS_URL)")
        self.cfg, self.trainer, self.stop = cfg, trainer, stop
        self.inst = instance_id("learner")
        # At maxmemory rank 0 pauses on the refused write, even when asked to stop: giving up half
        # way through a step could record groups as trained in Redis but not in a checkpoint; if
        # the pause outlasts the grace period, SIGKILL and a restart lose nothing. With several
        # ranks, a pause longer than learner.collective_timeout_s times the others out (a restart).
        self.bus = open_bus(url, cfg.queue.namespace, self.inst)
        self.bus.check_memory_policy()
        self.bus.ensure_groups()
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        alg = cfg.algorithm
        self.feeder = PromptFeeder(
            self.bus, load_prompts(cfg.data.train_path), self.tokenizer, run_name=cfg.run_name,
            limit=PromptFeeder.admission_limit(alg.max_staleness, alg.train_batch_groups, alg.oversampling),
            kept_ahead=(alg.max_staleness + 1) * alg.train_batch_groups,
            max_prompt_len=cfg.data.max_prompt_len, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
        )
        self.publisher = WeightPublisher(
            self.bus, host=os.environ.get("DAPO_WEIGHTS_HOST", "127.0.0.1"), port=0,
            backend=backend if cfg.learner.weights_backend == "auto" else cfg.learner.weights_backend,
            timeout_s=cfg.learner.collective_timeout_s, bucket_mb=cfg.learner.broadcast_bucket_mb,
        )
        self.eval_engine = HFEngine(cfg.model.path, seed=cfg.learner.seed)
        self.eval_records, self.eval_ids = eval_prompts(cfg, self.tokenizer)
        self.version = 0
        self.step = 0
        self.state = "starting"
        self.wait_s = 0.0
        self.started = time.monotonic()
        self.lags: list[float] = []
        self.evals: list[tuple[int, float]] = self.bus.eval_history()
        self.pending: list[tuple[str, RolloutGroup]] = []
        self.picked: list[tuple[str, RolloutGroup]] = []
        # Only one coordinator runs at a time, so any group pending in the train stream belongs
        # to a previous incarnation that died before training it: take those over first.
        self.orphans = self.take_over_pending()
        self.trackers = Trackers(cfg)
        self.hb = Heartbeat(self.bus, "learner", self.inst, cfg.queue.heartbeat_ttl_s, self.status).start()
        self.bus.update_run_info({RunField.RUN_NAME: cfg.run_name, RunField.ALIVE_MARKER: self.inst})

    def check_redis_state(self) -> None:
        """Detect Redis having lost the run's state (restarted without AOF, or flushed): the
        marker written at start is gone. The loss is reported in /status and the counters, never
        hidden; work that was queued is gone with it, and the ledger restarts from zero."""
        if self.bus.run_field(RunField.ALIVE_MARKER) is not None:
            return
        lost_at = time.time()
        log.error("Redis lost the run's state (queued groups and ledger are gone); continuing from step %d", self.step)
        self.bus.ensure_groups()
        self.pending, self.picked, self.orphans = [], [], []
        self.bus.update_run_info({
            RunField.RUN_NAME: self.cfg.run_name, RunField.ALIVE_MARKER: self.inst, RunField.REDIS_DATA_LOST_AT: lost_at,
            RunField.DATA_CURSOR: self.feeder.cursor, RunField.EVAL_HISTORY: json.dumps(self.evals),
        })
        self.bus.set_policy_version(self.version)
        self.bus.incr(Counter.REDIS_DATA_LOSS)

    def resume_from(self, meta: dict[str, Any] | None) -> None:
        """Continue numbering after a restart: step and data cursor from the checkpoint (or what
        Redis recorded later), and a policy version above anything a replica may already hold,
        so versions never go backwards."""
        redis_version = self.bus.policy_version()
        redis_cursor = int(self.bus.run_field(RunField.DATA_CURSOR) or 0)
        if meta is None:
            self.version = redis_version
            self.feeder.cursor = redis_cursor
        else:
            self.step = int(meta["step"])
            ckpt_version = int(meta["policy_version"])
            self.version = ckpt_version if redis_version <= ckpt_version else redis_version + 1
            self.feeder.cursor = max(int(meta["data_cursor"]), redis_cursor)
        self.bus.set_policy_version(self.version)

    def status(self) -> dict[str, Any]:
        return {"policy_version": self.version, "step": self.step, "state": self.state}

    def set_state(self, state: str) -> None:
        self.state = state
        self.bus.set_learner_state(state, step=self.step, policy_version=self.version)

    # --- data in ------------------------------------------------------------------------------
    def collect(self, budget_s: float = 5.0) -> list[tuple[str, RolloutGroup]] | None:
        """Gather fresh kept groups for up to budget_s; the full batch once it is in hand, else
        None (the caller keeps the other ranks alive meanwhile). Partial batches are kept."""
        need, stage = self.cfg.algorithm.train_batch_groups, self.bus.keys.train
        start = time.monotonic()
        self.set_state("waiting for data")
        while len(self.pending) < need and time.monotonic() - start < budget_s and not self.stop.stopping:
            self.feeder.admit(self.version)
            self.bus.update_run_info({RunField.DATA_CURSOR: self.feeder.cursor})
            entries = self.orphans or self.bus.read(stage, count=need - len(self.pending), block_ms=200)
            self.orphans = []
            for entry_id, fields in entries:
                try:
                    group = decode_group(fields)
                except SchemaError as exc:
                    self.bus.dead_letter(stage, entry_id, fields, f"learner: {exc}")
                    continue
                if self.version - group.policy_version > self.cfg.algorithm.max_staleness:
                    self.bus.hop(stage, entry_id, outcome=LEDGER_STALE)
                else:
                    self.pending.append((entry_id, group))
            self.publisher.catch_up()
        self.wait_s += time.monotonic() - start
        if len(self.pending) < need:
            return None
        batch, self.pending = self.pending[:need], self.pending[need:]
        fresh = [(eid, g) for eid, g in batch if self.version - g.policy_version <= self.cfg.algorithm.max_staleness]
        if len(fresh) < need:  # groups left over from before the last step may have aged
            for entry_id, _ in (p for p in batch if p not in fresh):
                self.bus.hop(stage, entry_id, outcome=LEDGER_STALE)
            self.pending = fresh + self.pending
            return None
        return batch

    def take_over_pending(self) -> list[tuple[str, dict[bytes, bytes]]]:
        stage = self.bus.keys.train
        taken = self.bus.reclaim(stage, min_idle_s=0.0, max_deliveries=self.cfg.queue.max_deliveries, count=100_000)
        if taken:
            log.info("took over %d groups a previous learner had not trained", len(taken))
        return taken

    def mark_trained(self) -> None:
        """Count the picked groups as trained; a group id seen before is counted as a duplicate."""
        keys = self.bus.keys
        for entry_id, group in self.picked:
            self.bus.hop(keys.train, entry_id, outcome=LEDGER_TRAINED)
            if not self.bus.mark_trained_id(group.job.group_id):
                self.bus.incr(Counter.TRAINED_TWICE)
                log.error("group %s was trained twice", group.job.group_id)
        self.picked = []

    def control_requests(self) -> dict[str, dict[str, Any]]:
        """Operator requests posted through the API (pause stays set until resumed)."""
        return {k: r.model_dump() for k, r in self.bus.control_requests().items()}

    def clear_request(self, name: str) -> None:
        self.bus.clear_control(name)

    # --- reporting ----------------------------------------------------------------------------
    def rollout_metrics(self, groups: list[RolloutGroup]) -> dict[str, float]:
        rewards = [r for g in groups for r in (g.rewards or [])]
        accs = [float(a) for g in groups for a in (g.acc or [])]
        lengths = [len(r.token_ids) for g in groups for r in g.responses]
        lags = [float(self.version - g.policy_version) for g in groups]
        self.lags.extend(lags)
        ledger = self.bus.ledger()
        rate = self.bus.pass_rate(ledger.filtered)
        return {
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/acc_mean": sum(accs) / len(accs),
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": float(max(lengths)),
            "rollout/clip_ratio": sum(r.finish_reason == "length" for g in groups for r in g.responses) / len(lengths),
            "rollout/version_lag_mean": sum(lags) / len(lags),
            "rollout/tokens": float(sum(lengths)),
            "rollout/groups": float(len(groups)),
            **{f"depth/{stage}": float(n) for stage, n in self.bus.depths().items()},
            "gate/pass_rate": 0.0 if rate is None else rate,
            "gate/filtered_total": float(ledger.filtered),
            "ledger/issued": float(ledger.issued),
            "ledger/in_flight": float(ledger.in_flight),
        }

    def report(self, metrics: dict[str, float]) -> None:
        record = {"step": self.step, "policy_version": self.version, "time": time.time(), **metrics}
        self.bus.append_metrics(record)
        self.trackers.log(self.step, metrics)
        log.info(
            "step %d v%d reward %.3f acc %.3f pass %.2f lag %.2f clip %.3f/%.3f kl %.4f %s",
            self.step, self.version, metrics.get("rollout/reward_mean", 0), metrics.get("rollout/acc_mean", 0),
            metrics.get("gate/pass_rate", 0), metrics.get("rollout/version_lag_mean", 0),
            metrics.get("actor/clipfrac_high", 0), metrics.get("actor/clipfrac_low", 0),
            metrics.get("actor/approx_kl", 0),
            f"eval {metrics['eval/acc']:.3f}" if "eval/acc" in metrics else "",
        )

    def sync_eval_model(self) -> None:
        """Load the newest published weights into rank 0's evaluation/export model."""
        if self.publisher.version < 0:
            return
        params = dict(self.eval_engine.model.named_parameters())
        with torch.no_grad():
            for flat, bucket in zip(self.publisher.flat, self.publisher.buckets, strict=True):
                for name, tensor in unflatten(flat, bucket):
                    params[name].copy_(tensor)

    def export_hf(self, out: Path) -> None:
        """A Hugging Face folder (safetensors + config + tokenizer) of the published weights."""
        self.sync_eval_model()
        self.eval_engine.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)

    def run_eval(self) -> dict[str, float]:
        if not self.eval_records:
            return {}
        self.set_state("evaluating")
        self.sync_eval_model()
        result = evaluate(self.eval_engine, self.tokenizer, self.eval_records, self.eval_ids, self.cfg)
        self.evals.append((self.step, result["eval/acc"]))
        self.trackers.log(self.step, result)
        self.bus.update_run_info({RunField.EVAL_HISTORY: json.dumps(self.evals)})
        log.info("eval at step %d: avg@%d = %.3f", self.step, self.cfg.eval.samples_per_problem, result["eval/acc"])
        return result

    # --- end of run ---------------------------------------------------------------------------
    def drain(self, timeout_s: float = 120.0) -> None:
        """Stop issuing and account for every job still in flight (counted `stale`)."""
        self.set_state("draining")
        keys, deadline = self.bus.keys, time.monotonic() + timeout_s
        for entry_id, _ in [*self.pending, *self.orphans, *self.take_over_pending()]:
            self.bus.hop(keys.train, entry_id, outcome=LEDGER_STALE)
        self.pending, self.orphans = [], []
        drainer = StreamBus(self.bus.redis, keys, consumer=f"{self.inst}-drain")
        for entry_id, _ in drainer.read(keys.prompts, count=1_000_000, block_ms=1):  # undelivered jobs
            drainer.hop(keys.prompts, entry_id, outcome=LEDGER_STALE)
        while time.monotonic() < deadline:
            for entry_id, _ in self.bus.read(keys.train, count=1000, block_ms=100):
                self.bus.hop(keys.train, entry_id, outcome=LEDGER_STALE)
            if self.bus.ledger().in_flight == 0:
                break
            self.publisher.catch_up()  # a replica waiting for weights must not hold jobs forever
        ledger = self.bus.ledger()
        if ledger.in_flight:
            log.warning("drain timed out with %d jobs in flight; stream depths %s", ledger.in_flight, self.bus.depths())
        log.info("drained: %s", ledger.as_dict())

    def save_final(self) -> Path:
        out = Path(self.cfg.output_dir) / "final_model"
        self.export_hf(out)
        return out

    # --- checkpoints and the end of the run ---------------------------------------------------
    def checkpoint_meta(self) -> dict[str, Any]:
        metrics = self.bus.last_metrics()
        return {
            "policy_version": self.version,
            "data_cursor": self.feeder.cursor,
            "ledger": self.bus.ledger().as_dict(),
            "eval_history": self.evals,
            "metrics": {k: v for k, v in metrics.items() if k.startswith(("eval/", "rollout/reward", "rollout/acc"))},
            "config": self.cfg.model_dump(mode="json"),
        }

    def finish(self) -> None:
        """A completed run: final evaluation, drain the pipeline, export the model, record the
        summary. A stopped one (SIGTERM; the checkpoint is already written) only records where
        it stopped, so the process exits within its grace period; its groups in flight stay
        queued for the learner that resumes."""
        completed = self.step >= self.cfg.learner.total_steps and not self.stop.stopping
        wall = time.monotonic() - self.started
        summary: dict[str, Any] = {
            "steps": self.step, "policy_version": self.version, "finished": int(completed),
            "learner_idle_fraction": self.wait_s / wall, "learner_wall_s": wall,
            "mean_version_lag": sum(self.lags) / len(self.lags) if self.lags else 0.0,
        }
        if completed:
            summary["final_eval_acc"] = self.run_eval().get("eval/acc", -1.0)
            self.drain()
            summary["final_model"] = str(self.save_final())
        self.bus.update_run_info({RunField(k): v for k, v in summary.items()})
        self.set_state("finished" if completed else "stopped")
        self.trackers.close()
