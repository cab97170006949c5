"""The learner loop with fakes: no Redis, no processes, no process group.

Rank 0 is driven with a fake trainer, batch source, publisher, evaluator, exporter, run control
and reporter; another rank is driven with the real null collaborators and rank 0's recorded
commands, as `broadcast_object_list` would deliver them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from torch import Tensor

from contracts.bus import FencedError
from contracts.checkpoint_store import CheckpointRefused
from contracts.config import DapoConfig, load_config
from contracts.keys import Counter, RunField
from contracts.schemas import PromptJob, Response, ScoredGroup
from learner.commands import (
    Command,
    Pause,
    Picked,
    Progress,
    Restore,
    SaveCheckpoint,
    Stop,
    Train,
    Wait,
    resumed_policy_version,
)
from learner.loop import Collaborators, LearnerLoop
from learner.publish import Publication
from learner.report import group_metrics

REPO = Path(__file__).resolve().parents[2]


# --- fakes ----------------------------------------------------------------------------------------
def group(group_id: str, policy_version: int = 0) -> ScoredGroup:
    job = PromptJob(
        group_id=group_id,
        prompt_index=0,
        prompt_ids=[5, 6],
        ground_truth="1",
        issued_at=0.0,
        issued_version=policy_version,
    )
    responses = [
        Response(token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop"),
        Response(token_ids=[3], logprobs=[-0.3], finish_reason="length"),
    ]
    return ScoredGroup(
        job=job,
        policy_version=policy_version,
        replica_id="r0",
        responses=responses,
        scores=[1.0, -1.0],
        acc=[True, False],
        rewards=[1.0, -1.5],
        preds=["", ""],
    )


def batch(*gids: str, policy_version: int = 0) -> list[Picked]:
    return [Picked(f"e-{g}", group(g, policy_version)) for g in gids]


class FakeTrainer:
    def __init__(self) -> None:
        self.weight = torch.zeros(2, 3)
        self.steps: list[tuple[int, int]] = []  # (rows, policy_version)
        self.gathers = 0

    def param_shapes(self) -> list[tuple[str, Any]]:
        return [("w", self.weight)]

    def train_step(self, batch: Any, policy_version: int) -> dict[str, float]:
        self.steps.append((len(batch), policy_version))
        self.weight += 1.0
        return {"actor/pg_loss": 0.5, "actor/ppo_kl": 0.01}

    def named_full_params(self) -> Iterator[tuple[str, Tensor]]:
        self.gathers += 1
        yield "w", self.weight.clone()


class FakeCheckpoints:
    def __init__(self, stored: dict[int, dict[str, Any]] | None = None) -> None:
        self.stored = dict(stored or {})
        self.saved: list[tuple[int, bool]] = []
        self.exported: list[Path] = []

    def latest_step(self) -> int | None:
        return max(self.stored, default=None)

    def save(self, step: int, meta: dict[str, Any], *, keep: bool, hf_export: Any) -> Path:
        self.saved.append((step, keep))
        self.stored[step] = {**meta, "step": step}
        path = Path(f"/ckpt/step_{step}")
        hf_export(path / "hf")
        return path

    def load(self, step: int) -> dict[str, Any] | None:
        return self.stored.get(step)


class FakeSource:
    def __init__(self, batches: Sequence[list[Picked]], cursor: int = 0) -> None:
        self.batches = list(batches)
        self.cursor = cursor
        self.accounted: list[str] = []
        self.resumed: list[int] = []
        self.collected_at: list[int] = []
        self.drained = self.reset = False

    def resume(self, checkpoint_cursor: int) -> None:
        self.resumed.append(checkpoint_cursor)
        self.cursor = max(self.cursor, checkpoint_cursor)

    def collect(self, policy_version: int) -> list[Picked] | None:
        self.collected_at.append(policy_version)
        assert len(self.collected_at) < 100, "the loop keeps waiting for data that never comes"
        return self.batches.pop(0) if self.batches else None

    def account(self, picked: Sequence[Picked]) -> None:
        self.accounted += [p.entry_id for p in picked]

    @property
    def jobs_issued(self) -> int:  # no prompt is skipped here: every position was issued
        return self.cursor

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"data_cursor": self.cursor}

    def reset_after_data_loss(self) -> None:
        self.reset = True

    def drain(self) -> None:
        self.drained = True


class FakePublisher:
    """Publishes to two replicas in 0.25 s, recording the staged weights' bytes as sent."""

    def __init__(self) -> None:
        self.last_publication = Publication()
        self.staged_versions: list[int] = []
        self.weights: dict[str, Tensor] = {}
        self.published = 0

    def stage(
        self, policy_version: int, named_iter: Iterable[tuple[str, Tensor]], layout: Any
    ) -> None:
        self.staged_versions.append(policy_version)
        self.weights = dict(named_iter)

    def publish(self) -> bool:
        self.published += 1
        nbytes = sum(t.nbytes for t in self.weights.values())
        self.last_publication = Publication(seconds=0.25, nbytes=nbytes, replicas=2)
        return True

    def catch_up(self) -> None:
        pass

    def staged(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.weights.items())


class FakeEvaluations:
    """Issued rounds complete one poll later (replicas generate them meanwhile);
    acc 0.1 per round."""

    def __init__(self) -> None:
        self.issued: list[Progress] = []
        self.rl_seconds: list[float] = []
        self.queued: list[Progress] = []
        self.waited = False
        self.publications: list[tuple[int, float]] = []

    @property
    def in_flight(self) -> bool:
        return bool(self.queued)

    def published(self, progress: Progress, rl_seconds: float) -> None:
        self.publications.append((progress.policy_version, rl_seconds))

    def issue(self, progress: Progress, rl_seconds: float) -> None:
        self.issued.append(progress)
        self.rl_seconds.append(rl_seconds)
        self.queued.append(progress)

    def poll(self) -> list[tuple[int, dict[str, float]]]:
        done, self.queued = self.queued, []
        return [
            (p.step, {"eval/acc": 0.1 * (self.issued.index(p) + 1), "eval/response_length": 3.0})
            for p in done
        ]

    def wait(self, timeout_s: float) -> list[tuple[int, dict[str, float]]]:
        self.waited = True
        return self.poll()


class FakeExporter:
    def __init__(self) -> None:
        self.outs: list[Path] = []

    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None:
        assert "w" in dict(weights)
        self.outs.append(out)


class FakeControl:
    """`script`: what take_request hands out at successive decisions (None: no request).
    `lease_lost_at`: the lease check (counted from 1) from which another learner holds the lease,
    so that check and every later one raise `FencedError` as `RunControl.check_lease` does
    (0: never)."""

    def __init__(
        self,
        script: Sequence[Command | Exception | None] = (),
        published: int = 0,
        lost_at: int = -1,
        lease_lost_at: int = 0,
    ) -> None:
        self.script = list(script)
        self.published = published
        self.lost_at, self.decisions = lost_at, 0
        self.lease_lost_at, self.lease_checks = lease_lost_at, 0
        self.states: list[tuple[str, Progress]] = []
        self.run_info: dict[RunField, Any] = {}
        self.counters: dict[Counter, int] = {}
        self.closed = False

    def start(self, status: Any) -> None:
        self.status = status

    def announce(self, state: str, progress: Progress) -> None:
        self.states.append((state, progress))

    def published_policy_version(self) -> int:
        return self.published

    def set_policy_version(self, progress: Progress) -> None:
        self.published = progress.policy_version

    def take_request(self) -> Command | None:
        item = self.script.pop(0) if self.script else None
        if isinstance(item, Exception):
            raise item
        return item

    def lost_run_state(self, progress: Progress) -> bool:
        self.decisions += 1
        return self.decisions == self.lost_at

    def record(self, fields: Any) -> None:
        self.run_info.update(fields)

    def count(self, counter: Counter) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + 1

    def check_lease(self) -> None:
        self.lease_checks += 1
        if self.lease_lost_at and self.lease_checks >= self.lease_lost_at:
            raise FencedError(
                "this learner no longer holds the learner lease (now 9:learner-b); not writing"
            )

    def close(self) -> None:
        self.closed = True


class FakeReporter:
    def __init__(self) -> None:
        self.reports: list[tuple[Progress, dict[str, float]]] = []
        self.evals: list[tuple[int, float]] = []
        self.rewrote = self.closed = False

    @property
    def has_evals(self) -> bool:
        return bool(self.evals)

    mean_version_lag = 0.0

    def rollout_metrics(self, groups: Sequence[ScoredGroup], trained_on: int) -> dict[str, float]:
        return group_metrics(groups, trained_on)

    def record_eval(self, step: int, result: dict[str, float]) -> None:
        self.evals.append((step, result["eval/acc"]))

    def rewrite_eval_history(self) -> None:
        self.rewrote = True

    def report(self, progress: Progress, metrics: dict[str, float]) -> None:
        self.reports.append((progress, metrics))

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"eval_history": list(self.evals)}

    def close(self) -> None:
        self.closed = True


class FakeStop:
    def __init__(self, after_collects: int | None = None, source: FakeSource | None = None) -> None:
        self.after, self.source = after_collects, source

    @property
    def stopping(self) -> bool:
        return (
            self.after is not None
            and self.source is not None
            and len(self.source.collected_at) >= self.after
        )

    def wait(self, seconds: float) -> bool:
        return self.stopping


class Recorder:
    """Rank 0's `share`: identity, remembering what it shared."""

    def __init__(self) -> None:
        self.shared: list[Any] = []

    def __call__(self, value: Any) -> Any:
        self.shared.append(value)
        return value


class Replay:
    """Another rank's `share`: rank 0's values in order, whatever this rank offers."""

    def __init__(self, shared: list[Any]) -> None:
        self.shared = list(shared)

    def __call__(self, value: Any) -> Any:
        return self.shared.pop(0)


def config(tmp_path: Path, *overrides: str) -> DapoConfig:
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [f"output_dir={tmp_path}", "eval.every_steps=0", "checkpoint.every_steps=0", *overrides],
    )


def rank0(cfg: DapoConfig, **parts: Any) -> tuple[LearnerLoop, dict[str, Any]]:
    parts = {
        "trainer": FakeTrainer(),
        "checkpoints": FakeCheckpoints(),
        "source": FakeSource([]),
        "publisher": FakePublisher(),
        "evaluations": FakeEvaluations(),
        "exporter": FakeExporter(),
        "control": FakeControl(),
        "reporter": FakeReporter(),
        "share": Recorder(),
        "stop": FakeStop(),
        **parts,
    }
    roles = {f.name: parts[f.name] for f in fields(Collaborators)}
    loop = LearnerLoop(
        cfg,
        trainer=parts["trainer"],
        checkpoints=parts["checkpoints"],
        collaborators=Collaborators(**roles),
        share=parts["share"],
        stop=parts["stop"],
    )
    return loop, parts


# --- tests ----------------------------------------------------------------------------------------
def test_a_train_command_trains_publishes_the_next_policy_version_accounts_and_reports(
    tmp_path: Path,
) -> None:
    loop, p = rank0(config(tmp_path, "learner.total_steps=1"))
    loop.start()
    assert p["publisher"].staged_versions == [0]  # the starting weights
    loop.execute(Train(tuple(batch("a", "b"))))
    assert p["trainer"].steps == [(4, 0)]  # 2 groups x 2 responses, trained as policy version 0
    assert loop.progress == Progress(step=1, policy_version=1)
    assert p["publisher"].staged_versions == [0, 1] and p["publisher"].published == 2
    assert float(p["publisher"].weights["w"][0, 0]) == 1.0  # the trained weights went out
    assert p["control"].published == 1
    assert p["source"].accounted == ["e-a", "e-b"]
    ((progress, metrics),) = p["reporter"].reports
    assert progress == Progress(1, 1)
    assert (
        metrics["critic/rewards/mean"] == pytest.approx(-0.25)
        and metrics["critic/score/mean"] == 0.0
    )
    assert metrics["response_length/clip_ratio"] == 0.5 and metrics["response_length/max"] == 2.0
    assert metrics["actor/pg_loss"] == 0.5 and metrics["timing_s/sync_weights"] == 0.25
    # the step's publication (issue 39): its seconds under both names, its bytes (one (2, 3)
    # fp32 weight) and replicas
    assert {k: v for k, v in metrics.items() if k.startswith("weight_sync/")} == {
        "weight_sync/seconds": 0.25,
        "weight_sync/bytes": 24.0,
        "weight_sync/replicas": 2.0,
        "weight_sync/failed": 0.0,
    }
    assert {
        "timing_s/update_actor",
        "timing_s/step",
        "perf/learner_idle_fraction",
        "rollout/version_lag_mean",
    } <= set(metrics)


def test_a_completed_run_evaluates_drains_exports_and_records_the_summary(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, "learner.total_steps=4", "eval.every_steps=2", "checkpoint.every_steps=3"
    )
    source = FakeSource([batch("a"), batch("b"), batch("c"), batch("d")])
    loop, p = rank0(cfg, source=source, control=FakeControl([None, None, None, None]))
    assert loop.run() == 0
    assert [v for _, v in p["trainer"].steps] == [0, 1, 2, 3]
    assert p["evaluations"].issued == [
        Progress(0, 0),
        Progress(2, 2),
        Progress(4, 4),
    ]  # base, periodic, final
    assert p["evaluations"].waited  # the end of the run waits for the final round
    rl = p["evaluations"].rl_seconds  # training time when each evaluated version existed
    assert rl[0] == 0.0 and rl[1] > 0.0 and rl == sorted(rl)
    assert p["checkpoints"].saved == [(3, False), (4, False)]  # periodic, then the end of the run
    assert p["exporter"].outs == [
        Path("/ckpt/step_3/hf"),
        Path("/ckpt/step_4/hf"),
        tmp_path / "final_model",
    ]
    assert source.drained and source.accounted == ["e-a", "e-b", "e-c", "e-d"]
    info = p["control"].run_info
    assert (
        info[RunField.FINISHED] == 1
        and info[RunField.STEPS] == 4
        and info[RunField.POLICY_VERSION] == 4
    )
    assert info[RunField.BASE_EVAL_ACC] == pytest.approx(0.1) and info[
        RunField.FINAL_EVAL_ACC
    ] == pytest.approx(0.3)
    assert info[RunField.FINAL_MODEL] == str(tmp_path / "final_model")
    assert p["control"].states[-1][0] == "finished" and p["control"].closed
    assert [s for s, _ in p["reporter"].evals] == [
        0,
        2,
        4,
    ]  # each round recorded under the step it evaluated
    assert "eval/acc" not in p["reporter"].reports[1][1]  # training never waited for an evaluation


def test_a_run_without_rounds_in_it_trains_checkpoints_and_exports_but_evaluates_nothing(
    tmp_path: Path,
) -> None:
    """`eval.in_run: false`: no base, periodic or final round (its checkpoints are evaluated
    afterwards, `dapo eval --run`); the run still completes and records its summary."""
    cfg = config(
        tmp_path,
        "learner.total_steps=4",
        "eval.every_steps=2",
        "eval.in_run=false",
        "checkpoint.every_steps=2",
    )
    source = FakeSource([batch("a"), batch("b"), batch("c"), batch("d")])
    loop, p = rank0(cfg, source=source, control=FakeControl([None, None, None, None]))
    assert loop.run() == 0
    assert p["evaluations"].issued == [] and not p["evaluations"].waited
    assert p["checkpoints"].saved == [(2, False), (4, False)]
    info = p["control"].run_info
    assert info[RunField.FINISHED] == 1 and info[RunField.FINAL_EVAL_ACC] == -1.0
    assert RunField.BASE_EVAL_ACC not in info
    assert info[RunField.FINAL_MODEL] == str(tmp_path / "final_model")


class IssuingSource(FakeSource):
    """Issues `per_collect` prompt jobs each time a batch is collected, as the feeder does."""

    def __init__(self, batches: Sequence[list[Picked]], per_collect: int) -> None:
        super().__init__(batches)
        self.per_collect = per_collect

    def collect(self, policy_version: int) -> list[Picked] | None:
        self.cursor += self.per_collect
        return super().collect(policy_version)


def test_the_sample_budget_ends_a_completed_run_before_total_steps(tmp_path: Path) -> None:
    # tiny.yaml: 8 responses per job, so 2 jobs per collect request 16 responses: 48 after 3 steps.
    cfg = config(
        tmp_path, "learner.total_steps=10", "learner.sample_budget=48", "eval.every_steps=1"
    )
    source = IssuingSource([batch(g) for g in "abcdef"], per_collect=2)
    loop, p = rank0(cfg, source=source, control=FakeControl([None] * 10))
    assert loop.run() == 0
    assert loop.progress == Progress(3, 3)  # stopped at the budget, not at total_steps
    # The last step's evaluation is the final one, issued once (not also as a periodic round).
    assert p["evaluations"].issued == [
        Progress(0, 0),
        Progress(1, 1),
        Progress(2, 2),
        Progress(3, 3),
    ]
    assert (
        source.drained and p["control"].run_info[RunField.FINISHED] == 1
    )  # a completed run, not a stop
    assert p["exporter"].outs[-1] == tmp_path / "final_model"


def test_stop_finishes_the_step_checkpoints_and_exits_without_draining(tmp_path: Path) -> None:
    source = FakeSource([batch("a"), batch("b")])
    loop, p = rank0(
        config(tmp_path, "learner.total_steps=10"),
        source=source,
        stop=FakeStop(after_collects=1, source=source),
    )
    assert loop.run() == 0
    assert loop.progress == Progress(1, 1)
    assert p["checkpoints"].saved == [(1, False)]
    assert not source.drained and p["exporter"].outs == [Path("/ckpt/step_1/hf")]
    assert (
        p["control"].run_info[RunField.FINISHED] == 0
        and RunField.FINAL_EVAL_ACC not in p["control"].run_info
    )
    assert p["control"].states[-1][0] == "stopped"


def test_no_data_yet_means_wait(tmp_path: Path) -> None:
    loop, p = rank0(config(tmp_path, "learner.total_steps=1"))
    loop.start()
    assert isinstance(loop.decide(), Wait)
    assert p["control"].states[-1][0] == "waiting for data"


def test_redis_outage_means_wait_and_data_loss_resets_what_was_in_hand(tmp_path: Path) -> None:
    control = FakeControl([redis.ConnectionError("gone")], lost_at=2)
    loop, p = rank0(
        config(tmp_path, "learner.total_steps=1"), control=control, source=FakeSource([batch("a")])
    )
    loop.start()
    assert isinstance(loop.decide(), Wait) and not p["source"].reset
    assert isinstance(loop.decide(), Train)
    assert p["source"].reset and p["reporter"].rewrote


def test_operator_requests_checkpoint_pause_and_restore(tmp_path: Path) -> None:
    source = FakeSource([batch("a"), batch("b"), batch("c"), batch("d")])
    script = [None, None, SaveCheckpoint(keep=True), Pause(), Restore(step=1), Restore(step=99)]
    cfg = config(tmp_path, "learner.total_steps=3", "checkpoint.every_steps=1")
    loop, p = rank0(cfg, source=source, control=FakeControl(script))
    loop.run()
    ckpt, control = p["checkpoints"], p["control"]
    # steps 1, 2 (periodic), the kept one at 2; back to step 1 as policy version 3; steps 2, 3 again
    assert ckpt.saved == [(1, False), (2, False), (2, True), (2, False), (3, False)]
    assert [v for _, v in p["trainer"].steps] == [0, 1, 3, 4]
    assert "paused" in [s for s, _ in control.states]
    assert control.counters == {Counter.RESTORES: 1}  # the restore of a missing step is ignored
    assert p["publisher"].staged_versions == [0, 1, 2, 3, 4, 5]
    assert loop.progress == Progress(3, 5) and control.run_info[RunField.FINISHED] == 1


class TamperedCheckpoints(FakeCheckpoints):
    """Step 1 fails verification (its files do not match its manifest),
    as the real store refuses it."""

    def load(self, step: int) -> dict[str, Any] | None:
        if step == 1:
            raise CheckpointRefused(
                "refusing checkpoint /ckpt/step_1: state/__0_0.distcp differs from the manifest"
            )
        return super().load(step)


def test_a_restore_of_a_tampered_checkpoint_is_refused_and_training_goes_on(tmp_path: Path) -> None:
    source = FakeSource([batch("a"), batch("b"), batch("c")])
    cfg = config(tmp_path, "learner.total_steps=3", "checkpoint.every_steps=1")
    loop, p = rank0(
        cfg,
        source=source,
        control=FakeControl([None, None, Restore(step=1)]),
        checkpoints=TamperedCheckpoints(),
    )
    loop.run()
    control = p["control"]
    assert control.counters == {Counter.RESTORES_REFUSED: 1}  # refused, not restored, and not fatal
    assert [v for _, v in p["trainer"].steps] == [0, 1, 2]  # steps 1-3 in one line: nothing rewound
    assert p["publisher"].staged_versions == [0, 1, 2, 3]  # and no extra publication for a restore
    assert loop.progress == Progress(3, 3) and control.run_info[RunField.FINISHED] == 1


class LeaseWitness(FakeCheckpoints):
    """Records, at each save, how many lease checks the run control had made by then."""

    def __init__(self, control: FakeControl) -> None:
        super().__init__()
        self.control = control
        self.lease_checks_at_save: list[int] = []

    def save(self, step: int, meta: dict[str, Any], *, keep: bool, hf_export: Any) -> Path:
        self.lease_checks_at_save.append(self.control.lease_checks)
        return super().save(step, meta, keep=keep, hf_export=hf_export)


def test_every_checkpoint_is_preceded_by_its_own_lease_check(tmp_path: Path) -> None:
    # An operator's checkpoint at step 1, the periodic one at step 2,
    # the end of the run's at step 3.
    control = FakeControl([None, SaveCheckpoint(keep=True), None, None])
    ckpt = LeaseWitness(control)
    source = FakeSource([batch("a"), batch("b"), batch("c")])
    loop, _ = rank0(
        config(tmp_path, "learner.total_steps=3", "checkpoint.every_steps=2"),
        control=control,
        checkpoints=ckpt,
        source=source,
    )
    assert loop.run() == 0
    assert ckpt.saved == [(1, True), (2, False), (3, False)]
    assert ckpt.lease_checks_at_save == [1, 2, 3]  # the k-th save came after the k-th check
    assert control.lease_checks == 3  # checked before checkpoints only: training needs no check


def test_a_learner_that_lost_its_lease_writes_no_checkpoint(tmp_path: Path) -> None:
    """Another learner took the lease after step 1's checkpoint: step 2's is refused before
    anything is written (the Hugging Face export included), and the loop stops."""
    control = FakeControl(lease_lost_at=2)
    ckpt = LeaseWitness(control)
    source = FakeSource([batch("a"), batch("b"), batch("c")])
    loop, p = rank0(
        config(tmp_path, "learner.total_steps=3", "checkpoint.every_steps=1"),
        control=control,
        checkpoints=ckpt,
        source=source,
    )
    with pytest.raises(FencedError, match="no longer holds the learner lease"):
        loop.run()
    assert ckpt.saved == [(1, False)] and sorted(ckpt.stored) == [1]
    assert p["exporter"].outs == [Path("/ckpt/step_1/hf")]
    assert len(p["trainer"].steps) == 2  # it trained step 2 and went no further
    assert control.closed  # the lease is handed back on the way out


def test_resume_continues_numbering_above_what_was_published(tmp_path: Path) -> None:
    ckpt = FakeCheckpoints({3: {"step": 3, "policy_version": 3, "data_cursor": 48}})
    loop, p = rank0(
        config(tmp_path, "learner.total_steps=4"),
        checkpoints=ckpt,
        control=FakeControl(published=5),
    )
    loop.start()
    assert loop.progress == Progress(3, 6)
    assert p["source"].resumed == [48] and p["publisher"].staged_versions == [6]
    fresh, q = rank0(config(tmp_path, "learner.total_steps=4"), control=FakeControl(published=7))
    fresh.start()  # no checkpoint: continue from what Redis recorded
    assert fresh.progress == Progress(0, 7) and q["source"].resumed == [0]


def test_policy_versions_only_move_forward(tmp_path: Path) -> None:
    source = FakeSource([batch("a"), batch("b"), batch("c"), batch("d"), batch("e")])
    script = [None, None, Restore(step=1), None, Restore(step=1), None]
    loop, p = rank0(
        config(tmp_path, "learner.total_steps=3", "checkpoint.every_steps=1"),
        source=source,
        control=FakeControl(script),
    )
    loop.run()
    versions = [progress.policy_version for _, progress in p["control"].states]
    assert versions == sorted(versions)
    assert p["publisher"].staged_versions == sorted(set(p["publisher"].staged_versions))
    assert (
        resumed_policy_version(4, 4) == 4
        and resumed_policy_version(4, 2) == 4
        and resumed_policy_version(4, 9) == 10
    )
    assert Progress(1, 1).next_step().next_policy() == Progress(2, 2)


def test_other_ranks_follow_rank_0_with_null_collaborators(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, "learner.total_steps=3", "checkpoint.every_steps=2", "eval.every_steps=1"
    )
    source = FakeSource([batch("a"), None, batch("b"), batch("c")])  # type: ignore[list-item]
    ckpt = {1: {"step": 1, "policy_version": 1, "data_cursor": 16}}
    script = [None, SaveCheckpoint(), None, Pause(), Restore(step=1), None]
    share = Recorder()
    leader, p = rank0(
        cfg,
        source=source,
        control=FakeControl(script, published=1),
        share=share,
        checkpoints=FakeCheckpoints(ckpt),
    )
    leader.run()
    follower_trainer, follower_ckpt = FakeTrainer(), FakeCheckpoints(ckpt)
    follower = LearnerLoop(
        cfg,
        trainer=follower_trainer,
        checkpoints=follower_ckpt,
        collaborators=Collaborators.null(),
        share=Replay(share.shared),
        stop=FakeStop(),
    )
    assert follower.run() == 0
    assert follower_trainer.steps == p["trainer"].steps  # same batches, same policy versions
    assert (
        follower_trainer.gathers == p["trainer"].gathers
    )  # every weight gather matched (a collective)
    assert follower_ckpt.saved == p["checkpoints"].saved
    assert follower.progress == leader.progress
    assert any(isinstance(c, Restore) for c in share.shared) and isinstance(share.shared[-2], Stop)
    assert share.shared[-1] is True  # rank 0's "the run completed", which only it can know
