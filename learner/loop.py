"""The learner: one loop of named stages, the same on every rank.

    decide (rank 0) -> share -> collect -> build batch -> train -> publish -> account -> report

At each step boundary rank 0 decides the next command and shares it with every rank over the
learner's own process group; each rank then carries it out:

- `Train(picked)`: build the batch, take one DAPO step (all ranks), gather the new weights and
  publish them as policy version + 1, account the groups as trained, queue an evaluation round
  when due (replicas generate it; `learner/evaluation.py`), report, and report the evaluation
  rounds that completed meanwhile; then checkpoint when due.
- `Wait`: data still arriving, or Redis unreachable (the client already retried with back-off),
  so a Redis restart costs time, not the run. `Pause`: an operator paused training.
- `SaveCheckpoint(keep)`, `Restore(step)`: operator requests (and the periodic checkpoint).
- `Stop`: `total_steps` done or `sample_budget` spent (the run's end), or SIGTERM.

Everything rank 0 does beyond training goes through injected collaborators (batch source, weight
publisher, evaluation lane, exporter, run control, reporter); the other ranks get null ones, so the
loop has no rank branches. The loop alone holds `Progress` (step and policy version) and passes
it to collaborators.

On start the learner resumes from the newest committed checkpoint if there is one, numbering
policy versions above anything already published (versions never go backwards). A completed run
drains the training lane, evaluates the final weights (waiting for that round and any other
outstanding one: every issued job accounted for, in_flight 0), exports `<output_dir>/final_model`
and records its summary. On SIGTERM the learner finishes the
current step, commits a checkpoint and exits 0 without draining: the work in flight stays queued
for the learner that resumes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import redis

from contracts.checkpoint_store import CheckpointRefused
from contracts.config import DapoConfig
from contracts.faults import slowdown
from contracts.keys import Counter, RunField
from contracts.schemas import ScoredGroup
from learner.batch import build_batch
from learner.checkpoint import CheckpointStore
from learner.collect import BatchSource, NullSource
from learner.commands import (
    Command,
    Pause,
    Progress,
    Restore,
    SaveCheckpoint,
    Stop,
    Train,
    Wait,
    resumed_policy_version,
)
from learner.control import Control, NullControl
from learner.evaluation import Evaluations, NullEvaluations, RoundReport
from learner.export import Exporter, NullExporter
from learner.feeder import budget_jobs
from learner.publish import NullPublisher, Publisher
from learner.report import NullReporter, Reporter
from learner.trainer import NonFiniteTrainingError, StepTrainer

log = logging.getLogger(__name__)

T = TypeVar("T")


class Share(Protocol):
    """Rank 0's value, returned on every rank (identity on rank 0)."""

    def __call__(self, value: T) -> T: ...


class StopSignal(Protocol):
    @property
    def stopping(self) -> bool: ...

    def wait(self, seconds: float) -> bool: ...


@dataclass(frozen=True)
class Collaborators:
    """What a rank does beyond training: rank 0's talk to Redis, the replicas, the evaluation
    lane, the export and the trackers; every other rank gets the null ones
    (`learner/service.py`)."""

    source: BatchSource
    publisher: Publisher
    evaluations: Evaluations
    exporter: Exporter
    control: Control
    reporter: Reporter

    @classmethod
    def null(cls) -> Collaborators:
        """Every rank but 0: it trains and gathers weights; rank 0 does the rest."""
        return cls(
            source=NullSource(),
            publisher=NullPublisher(),
            evaluations=NullEvaluations(),
            exporter=NullExporter(),
            control=NullControl(),
            reporter=NullReporter(),
        )


class LearnerLoop:
    def __init__(
        self,
        cfg: DapoConfig,
        *,
        trainer: StepTrainer,
        checkpoints: CheckpointStore,
        collaborators: Collaborators,
        share: Share,
        stop: StopSignal,
    ) -> None:
        self.cfg, self.trainer, self.checkpoints = cfg, trainer, checkpoints
        c = collaborators
        self.source, self.publisher, self.evaluations = c.source, c.publisher, c.evaluations
        self.exporter, self.control, self.reporter = c.exporter, c.control, c.reporter
        self.share, self.stop = share, stop
        self.layout = trainer.param_shapes()
        self.progress = Progress()
        self.state = "starting"
        self.started = time.monotonic()
        self.slowdown = slowdown("learner.slowdown")  # None outside the fault suite
        self.waited_s = 0.0
        self.waited_before_step_s = 0.0
        """`waited_s` when the last step was reported: the difference is the step's own wait."""
        self.rl_clock: tuple[float, float] | None = None
        """(RL seconds before this process, when its first training step began); RL seconds are
        training time since the run's first step, evaluation and start-up excluded."""
        self.rl_seconds_before = 0.0

    def status(self) -> dict[str, Any]:
        """For the heartbeat (another thread): `progress` is replaced whole, never mutated."""
        progress = self.progress
        return {
            "state": self.state,
            "step": progress.step,
            "policy_version": progress.policy_version,
        }

    def run(self) -> int:
        try:
            self.start()
            while not isinstance(command := self.share(self.decide()), Stop):
                self.execute(command)
            self.finish()
        finally:
            self.control.close()
        return 0

    # --- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume (newest checkpoint, else what Redis recorded), publish the starting weights,
        and queue the evaluation of the base model once per run."""
        self.control.start(self.status)
        latest = self.checkpoints.latest_step()
        if latest is None:
            self._continue_from(Progress(0, self.control.published_policy_version()), data_cursor=0)
        else:
            self._restore(latest)
        self._publish()  # stage the starting weights (and sync replicas on a resume)
        if self.cfg.eval.in_run and not self.reporter.has_evals and not self.evaluations.in_flight:
            self.evaluations.issue(self.progress, self.rl_seconds)

    def _continue_from(self, progress: Progress, *, data_cursor: int) -> None:
        self.progress = self.share(progress)
        self.source.resume(data_cursor)
        self.control.set_policy_version(self.progress)

    def _restore(self, step: int) -> bool:
        self._set_state("restoring")
        meta = self.checkpoints.load(step)
        if meta is None:  # the API checks too; a race with retention lands here
            log.error("checkpoint step %d is gone; ignoring the restore request", step)
            return False
        published = max(self.control.published_policy_version(), self.progress.policy_version)
        policy_version = resumed_policy_version(int(meta["policy_version"]), published)
        self._continue_from(
            Progress(int(meta["step"]), policy_version), data_cursor=int(meta["data_cursor"])
        )
        self.rl_seconds_before, self.rl_clock = float(meta.get("rl_seconds", 0.0)), None
        log.info("restored checkpoint step %d as policy version %d", step, policy_version)
        return True

    # --- decide (rank 0; the other ranks' decision is replaced by rank 0's) -----------------------
    def decide(self) -> Command:
        try:
            if self.control.lost_run_state(self.progress):
                self.source.reset_after_data_loss()
                self.reporter.rewrite_eval_history()
            return self._next_command()
        except redis.ConnectionError as exc:
            log.warning("redis unavailable (%s); waiting", exc)
            self.stop.wait(1.0)
            return Wait()

    def _next_command(self) -> Command:
        if self.stop.stopping or self._reached_end():
            return Stop()
        return self.control.take_request() or self._collect()

    def _reached_end(self) -> bool:
        """`total_steps` trained, or the sample budget spent. Only rank 0 knows what was issued
        (the others hold a null source): share the answer where every rank acts on it."""
        jobs = budget_jobs(self.cfg.learner.sample_budget, self.cfg.rollout.group_size)
        spent = jobs is not None and self.source.jobs_issued >= jobs  # the feeder issues no more
        return self.progress.step >= self.cfg.learner.total_steps or spent

    def _collect(self) -> Train | Wait:
        self._set_state("waiting for data")
        t0 = time.monotonic()
        picked = self.source.collect(self.progress.policy_version)
        self.waited_s += time.monotonic() - t0
        return Wait() if picked is None else Train(tuple(picked))

    # --- execute (every rank) ------------------------------------------------------------------
    def execute(self, command: Command) -> None:
        match command:
            case Train():
                self._train(command)
                self._checkpoint_if_due()
            case SaveCheckpoint(keep=keep):
                self._checkpoint(keep=keep)
            case Restore(step=step):
                self._operator_restore(step)
            case Pause():
                self._set_state("paused")
                self.stop.wait(1.0)
            case Wait() | Stop():
                pass

    @property
    def rl_seconds(self) -> float:
        if self.rl_clock is None:
            return self.rl_seconds_before
        before, started = self.rl_clock
        return before + time.monotonic() - started

    def _train(self, command: Train) -> None:
        """build batch -> train -> publish -> account -> (evaluate when due) -> report."""
        t0 = time.monotonic()
        if self.rl_clock is None:
            self.rl_clock = (self.rl_seconds_before, t0)
        trained_on = self.progress.policy_version
        self.progress = self.progress.next_step()
        self._set_state("training")
        metrics = self._update_actor(command.groups, trained_on, t0)
        update_s = time.monotonic() - t0
        metrics |= self.reporter.rollout_metrics(command.groups, trained_on)
        self.progress = self.progress.next_policy()
        self._publish()
        self.source.account(command.picked)
        self._evaluate_if_due()
        metrics |= self._timing(update_s, time.monotonic() - t0)
        self.reporter.report(self.progress, metrics)
        self._record_evaluations(self.evaluations.poll())

    def _update_actor(
        self, groups: list[ScoredGroup], policy_version: int, t0: float
    ) -> dict[str, float]:
        alg = self.cfg.algorithm
        batch = build_batch(
            groups,
            pad_id=0,
            norm_by_std=alg.norm_by_std,
            overlong_filter=self.cfg.reward.overlong.filter,
        )
        # Non-finite steps (learner/trainer.py): a step that skipped an update is counted and goes
        # on as any other: its weights (unchanged if every update was skipped) are published as the
        # next policy version, so versions keep matching steps, and its groups are accounted trained
        # (consumed). The trainer raises on every rank after learner.max_nonfinite_steps in a row.
        try:
            metrics: dict[str, float] = self.trainer.train_step(
                batch, policy_version=policy_version
            )
        except NonFiniteTrainingError:
            self.control.count(Counter.NONFINITE_STEPS)  # the step that stops the run counts too
            raise
        if metrics.get("actor/nonfinite_steps"):
            self.control.count(Counter.NONFINITE_STEPS)
        if self.slowdown is not None:  # the fault suite only (contracts/faults.py)
            self.slowdown.after(time.monotonic() - t0)
        return metrics

    def _timing(self, update_s: float, step_s: float) -> dict[str, float]:
        wall = max(time.monotonic() - self.started, 1e-9)
        wait_s, self.waited_before_step_s = self.waited_s - self.waited_before_step_s, self.waited_s
        sync = self.publisher.last_publication  # this step's (learner/publish.py `Publication`)
        return {
            "timing_s/update_actor": update_s,
            # verl's name for `weight_sync/seconds`, the same value (issue 39)
            "timing_s/sync_weights": sync.seconds,
            "timing_s/step": step_s,
            "timing_s/wait_data": wait_s,
            "perf/learner_idle_fraction": self.waited_s / wall,
        } | sync.metrics()

    def _publish(self) -> None:
        """Gather the full weights (every rank); rank 0 stages and sends them to the replicas
        as the current policy version."""
        self._set_state("broadcasting")
        self.publisher.stage(
            self.progress.policy_version, self.trainer.named_full_params(), self.layout
        )
        self.control.set_policy_version(self.progress)
        self.publisher.publish()
        self.evaluations.published(self.progress, self.rl_seconds)

    def _evaluate_if_due(self) -> None:
        every, step = self.cfg.eval.every_steps, self.progress.step
        due = every and step % every == 0 and not self._reached_end()  # the last: in finish
        if self.cfg.eval.in_run and due:
            self.evaluations.issue(self.progress, self.rl_seconds)

    def _record_evaluations(self, reports: list[RoundReport]) -> dict[int, dict[str, float]]:
        """Record completed rounds (the run's first one is its base accuracy)."""
        for step, result in reports:
            if not self.reporter.has_evals:
                self.control.record({RunField.BASE_EVAL_ACC: result["eval/acc"]})
            self.reporter.record_eval(step, result)
        return dict(reports)

    def _checkpoint_if_due(self) -> None:
        every = self.cfg.checkpoint.every_steps
        if every and self.progress.step % every == 0:
            self._checkpoint(keep=False)

    def _checkpoint(self, *, keep: bool) -> None:
        self._set_state("checkpointing")
        self.control.check_lease()  # a superseded learner must not write into the store
        meta = {
            "policy_version": self.progress.policy_version,
            "rl_seconds": self.rl_seconds,
            **self.source.checkpoint_meta(),
            **self.reporter.checkpoint_meta(),
            "config": self.cfg.model_dump(mode="json"),
        }
        self.checkpoints.save(self.progress.step, meta, keep=keep, hf_export=self._export)

    def _export(self, out: Path) -> None:
        self.exporter.export(self.publisher.staged(), out)

    def _operator_restore(self, step: int) -> None:
        try:
            restored = self._restore(step)
        except CheckpointRefused as exc:
            # Raised before anything is loaded (the manifest check, the metadata's allow-list;
            # a refusal during the load itself surfaces as DCP's own error and stops the
            # learner), and by every rank alike: the run goes on from where it was, and the
            # operator sees why in the log.
            log.error("restore of step %d refused: %s", step, exc)
            self.control.count(Counter.RESTORES_REFUSED)
            return
        if restored:
            self.control.count(Counter.RESTORES)
            self._publish()

    def _set_state(self, state: str) -> None:
        self.state = state
        self.control.announce(state, self.progress)

    # --- finish --------------------------------------------------------------------------------
    def finish(self) -> None:
        """Checkpoint the end of the run. A completed run then evaluates, drains the pipeline
        and exports the final model; a stopped one (SIGTERM) only records where it stopped, so
        the process exits within its grace period and its work in flight stays queued."""
        step, every = self.progress.step, self.cfg.checkpoint.every_steps
        if step and (every == 0 or step % every):
            self._checkpoint(keep=False)
        completed = self.share(self._reached_end()) and not self.stop.stopping
        summary = self._summary(completed)
        if completed:
            summary |= self._complete()
        self.control.record(summary)
        self._set_state("finished" if completed else "stopped")
        self.reporter.close()

    def _summary(self, completed: bool) -> dict[RunField, str | int | float]:
        wall = max(time.monotonic() - self.started, 1e-9)
        return {
            RunField.STEPS: self.progress.step,
            RunField.POLICY_VERSION: self.progress.policy_version,
            RunField.FINISHED: int(completed),
            RunField.LEARNER_IDLE_FRACTION: self.waited_s / wall,
            RunField.LEARNER_WALL_S: wall,
            RunField.MEAN_VERSION_LAG: self.reporter.mean_version_lag,
        }

    def _complete(self) -> dict[RunField, str | int | float]:
        self._set_state("draining")
        self.source.drain()
        final_acc = -1.0
        if self.cfg.eval.in_run:
            self._set_state("evaluating")
            self.evaluations.issue(self.progress, self.rl_seconds)
            final = self._record_evaluations(self.evaluations.wait(self.cfg.eval.final_wait_s))
            final_acc = final.get(self.progress.step, {}).get("eval/acc", -1.0)
        out = Path(self.cfg.output_dir) / "final_model"
        self._export(out)
        return {RunField.FINAL_EVAL_ACC: final_acc, RunField.FINAL_MODEL: str(out)}
