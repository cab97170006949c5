"""Evaluation on the inference engine (docs/algorithm.md s7, avg@k): rank 0's evaluation lane.

The learner holds no evaluation model and never waits for an evaluation while training. To
evaluate the weights of step s (just published as policy version v) it issues one evaluation job
per distinct eval problem into the prompt stream (`PromptJob.eval`: k samples with the eval
sampling settings). Rollout replicas generate them beside the training jobs, reward workers score
them, and the gatekeeper reduces each to an `EvalResult` on the evaluation stream. After every
step the learner reads that stream without blocking and reports each round whose problems are
all in.

A round's results stay pending in the stream until the round is complete, then are acknowledged
together (counted `evaluated` in the ledger). A learner that restarts mid-round takes the pending
results over and finishes the round: every job's tag carries the round's step, version and size,
so nothing about a round lives only in the process.

Credit to the policy that produced it. A round's jobs queue behind training jobs already
issued, so replicas may hold a newer policy than the one published when the round was issued
(generation is asynchronous). Each result records the versions that generated its responses
(`EvalResult.policy_version_min` / `_max`), and the round is credited to the newest of them: its
`eval/step` and `eval/rl_seconds` are the step that published that version and the RL seconds at
which it was published (`published`), so a curve, a time to target and the summary read the
accuracy against the weights that earned it, never earlier (crediting the issuing step would
flatter a run by the 2-4 versions its replicas were ahead). A transformers-engine replica serves a
round at one version (rollout/service.py); one whose min and max differ mixed policies (replicas
at different versions, or vLLM taking a broadcast mid-round) and its log line names the range.
`eval/issued_step` and `eval/policy_version_lag` (the newest version minus the one the round was
issued at) say how far ahead the replicas were. After a learner restart the publication times of
versions before it are unknown; a round of those versions keeps its issuing step and time
(`eval/credited_at_issue` = 1).

Each round also carries each task's accuracy (`task/<name>/eval_acc`, its problems grouped by
`data_source`: a reasoning-gym mixture's per-task evaluation sets, issue 42) and a bootstrap 95%
interval over problems (`eval/acc_ci_low`, `_high`,
`contracts.eval_stats`), and its per-problem accuracies are appended to
`<output_dir>/eval_rounds.jsonl`, from which benches compare runs problem by problem (paired: the
replicas seed each evaluation sample by problem and index, `eval.seed`).

A round that lost jobs to the dead-letter stream is reported once the whole evaluation lane has
nothing left in flight, over the problems it has (`eval/problems`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from contracts.bus import Entry, RunState, Transport
from contracts.config import DapoConfig
from contracts.data import PromptRecord, encode_prompt
from contracts.eval_stats import EVAL_ROUNDS_FILE, Round, accuracy_interval
from contracts.heldout import Overlap, held_out_problems
from contracts.keys import LEDGER_EVALUATED
from contracts.schemas import (
    EvalResult,
    EvalTag,
    PromptJob,
    SchemaError,
    check_job_signature,
    decode_eval_result,
    encode_job,
)
from contracts.signing import SigningKey
from contracts.tasks import eval_task_metrics, task_label
from learner.commands import Progress

log = logging.getLogger(__name__)

RoundReport = tuple[int, dict[str, float]]
"""(the step whose weights produced the round, its eval metrics)."""


class Evaluations(Protocol):
    @property
    def in_flight(self) -> bool:
        """Some evaluation job is still being generated, scored or added up."""
        ...

    def published(self, progress: Progress, rl_seconds: float) -> None:
        """The weights of `progress` were published `rl_seconds` into training (the time a
        round that measured them is credited to)."""
        ...

    def issue(self, progress: Progress, rl_seconds: float) -> None:
        """Queue a round evaluating the weights just published at `progress` (they existed
        `rl_seconds` into training)."""
        ...

    def poll(self) -> list[RoundReport]:
        """Rounds completed since the last call; never blocks."""
        ...

    def wait(self, timeout_s: float) -> list[RoundReport]:
        """Every outstanding round, waiting up to `timeout_s` (the end of a run)."""
        ...


class NullEvaluations:
    """No eval set, or a rank other than 0."""

    in_flight = False

    def published(self, progress: Progress, rl_seconds: float) -> None:
        pass

    def issue(self, progress: Progress, rl_seconds: float) -> None:
        pass

    def poll(self) -> list[RoundReport]:
        return []

    def wait(self, timeout_s: float) -> list[RoundReport]:
        return []


@dataclass
class _Round:
    tag: EvalTag
    results: dict[int, EvalResult] = field(default_factory=dict)
    """By problem index; a second result for a problem (a redelivery) is acknowledged at once."""
    entry_ids: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.results) == self.tag.problems

    @property
    def per_problem(self) -> list[float]:
        """Accuracy of each problem that arrived, in problem order."""
        return [self.results[i].correct / self.results[i].samples for i in sorted(self.results)]

    def metrics(self, issued_at: float | None) -> dict[str, float]:
        results = list(self.results.values())
        samples = sum(r.samples for r in results)
        low, high = accuracy_interval(self.per_problem)
        out = {
            "eval/acc": sum(r.correct for r in results) / samples,
            "eval/acc_ci_low": low,
            "eval/acc_ci_high": high,
            "eval/issued_step": float(self.tag.round_step),
            "eval/response_length": sum(r.response_tokens for r in results) / samples,
            "eval/clip_ratio": sum(r.truncated for r in results) / samples,
            "eval/problems": float(len(results)),
            "eval/samples_per_problem": float(self.tag.samples),
            "eval/policy_version_min": float(min(r.policy_version_min for r in results)),
            "eval/policy_version_max": float(max(r.policy_version_max for r in results)),
            "eval/rl_seconds": self.tag.rl_seconds,
        }
        out["eval/policy_version_lag"] = out["eval/policy_version_max"] - self.tag.policy_version
        if issued_at is not None:
            out["eval/seconds"] = time.monotonic() - issued_at
        return out


class EvalLane:
    """Rank 0: issues rounds into the prompt stream and adds up their results."""

    def __init__(
        self,
        prompts: list[tuple[list[int], str, str]],
        *,
        transport: Transport,
        run_state: RunState,
        run_name: str,
        samples: int,
        max_deliveries: int,
        catch_up: Callable[[], None],
        extra_infos: list[dict[str, Any]] | None = None,
        rounds_path: Path | None = None,
        job_key: SigningKey | None = None,
    ) -> None:
        """prompts: (prompt ids, ground truth, data source) per distinct problem; extra_infos: each
        problem's data-row `extra_info` (for a `reward.function`), or None for none; rounds_path:
        where each round's per-problem record is appended (None: nowhere); job_key: the learner's
        key, which signs every job (`PromptJob.sig`; None: unsigned)."""
        self.job_key = job_key
        # The parts of the bus it touches: `transport` (rounds out as jobs, results in from the
        # evaluation lane) and `run_state` (the rounds already reported).
        self.transport, self.run_state = transport, run_state
        self.prompts, self.run_name, self.samples, self.catch_up = (
            prompts,
            run_name,
            samples,
            catch_up,
        )
        self.extra_infos, self.rounds_path = extra_infos, rounds_path
        self.publications: dict[int, tuple[int, float]] = {}
        """policy version -> (the step that published it, RL seconds then)."""
        # Rounds are keyed by the policy version they evaluate: versions never repeat, while a
        # step can (a learner that resumes from an older checkpoint retrains it).
        self.rounds: dict[int, _Round] = {}
        self.issued_at: dict[int, float] = {}
        self.finished: set[int] = set()
        # Only one learner runs at a time: results pending in the stream were held by a previous
        # incarnation for rounds it had not finished. Take them over.
        self.taken_over: list[Entry] = transport.reclaim(
            transport.keys.evals, min_idle_s=0.0, max_deliveries=max_deliveries, count=1_000_000
        )
        # Every round reported is in the run's history: with none there, what the file holds is
        # an earlier run's.
        if rounds_path is not None and not run_state.eval_history():
            rounds_path.unlink(missing_ok=True)

    @property
    def in_flight(self) -> bool:
        return bool(self.rounds) or self.transport.ledger().eval_in_flight > 0

    def published(self, progress: Progress, rl_seconds: float) -> None:
        self.publications[progress.policy_version] = (progress.step, rl_seconds)

    def issue(self, progress: Progress, rl_seconds: float) -> None:
        if progress.policy_version in self.issued_at or progress.policy_version in self.finished:
            return
        now, n = time.time(), len(self.prompts)
        jobs = [
            encode_job(
                PromptJob(
                    group_id=f"{self.run_name}-eval{progress.step}-{i}",
                    prompt_index=i,
                    prompt_ids=ids,
                    ground_truth=truth,
                    data_source=source,
                    issued_version=progress.policy_version,
                    issued_at=now,
                    extra_info=self.extra_infos[i] if self.extra_infos is not None else {},
                    eval=EvalTag(
                        round_step=progress.step,
                        policy_version=progress.policy_version,
                        problem=i,
                        problems=n,
                        samples=self.samples,
                        rl_seconds=rl_seconds,
                    ),
                ),
                self.job_key,
            )
            for i, (ids, truth, source) in enumerate(self.prompts)
        ]
        self.transport.issue(jobs, evaluation=True)
        self.issued_at[progress.policy_version] = time.monotonic()
        log.info(
            "evaluation of step %d (policy version %d) issued: %d problems x %d samples",
            progress.step,
            progress.policy_version,
            n,
            self.samples,
        )

    def poll(self) -> list[RoundReport]:
        entries, self.taken_over = (
            self.taken_over
            + self.transport.read(self.transport.keys.evals, count=100_000, block_ms=None),
            [],
        )
        for entry_id, fields in entries:
            self._add(entry_id, fields)
        done = [version for version, r in self.rounds.items() if r.complete]
        if self.rounds and not done and self._lane_quiet():  # jobs were lost: report what arrived
            done = list(self.rounds)
        return [self._finish(version) for version in sorted(done)]

    def wait(self, timeout_s: float) -> list[RoundReport]:
        deadline, reports = time.monotonic() + timeout_s, []
        while True:
            reports += self.poll()
            if not self.in_flight:
                return reports
            if time.monotonic() > deadline:
                log.warning(
                    "evaluation still in flight after %.0f s: rounds %s unreported",
                    timeout_s,
                    sorted(self.rounds),
                )
                return reports
            self.catch_up()  # a replica waiting for weights must not hold evaluation jobs forever
            time.sleep(0.1)

    def _add(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        stage = self.transport.keys.evals
        try:
            result = decode_eval_result(fields)
        except SchemaError as exc:
            self.transport.dead_letter(stage, entry_id, fields, f"learner: {exc}")
            return
        if self.job_key is not None:
            try:
                check_job_signature(result, self.job_key)
            except SchemaError as exc:  # not one of our jobs: the ledger never counted it
                self.transport.dead_letter(stage, entry_id, fields, f"learner: {exc}", foreign=True)
                return
        version = result.tag.policy_version
        rnd = (
            None
            if version in self.finished
            else self.rounds.setdefault(version, _Round(result.tag))
        )
        if (
            rnd is None or result.tag.problem in rnd.results
        ):  # a stray of a round reported, or a duplicate
            self.transport.hop(stage, entry_id, outcome=LEDGER_EVALUATED)
            return
        rnd.results[result.tag.problem] = result
        rnd.entry_ids.append(entry_id)

    def _lane_quiet(self) -> bool:
        """Every evaluation job still in flight is a result held here: nothing more will come."""
        held = sum(len(r.entry_ids) for r in self.rounds.values())
        return self.transport.ledger().eval_in_flight == held

    def _finish(self, version: int) -> RoundReport:
        rnd = self.rounds.pop(version)
        for entry_id in rnd.entry_ids:
            self.transport.hop(self.transport.keys.evals, entry_id, outcome=LEDGER_EVALUATED)
        self.finished.add(version)
        metrics = rnd.metrics(self.issued_at.pop(version, None))
        metrics |= eval_task_metrics(self._task_outcomes(rnd))
        step = self._credit(rnd, metrics)
        if not rnd.complete:
            log.warning(
                "evaluation of step %d lost %d of %d problems (dead-lettered)",
                step,
                rnd.tag.problems - len(rnd.results),
                rnd.tag.problems,
            )
        # Replicas at different versions may take a round's jobs: normal when asynchronous, and
        # said in the same line so the accuracy is read against the policies it measured.
        low, high = int(metrics["eval/policy_version_min"]), int(metrics["eval/policy_version_max"])
        log.info(
            "evaluation of step %d: avg@%d = %.3f over %d problems, policy versions %s",
            step,
            rnd.tag.samples,
            metrics["eval/acc"],
            len(rnd.results),
            low if low == high else f"{low}..{high}",
        )
        self._append_record(step, rnd, metrics)
        return step, metrics

    def _task_outcomes(self, rnd: _Round) -> dict[str, tuple[int, int]]:
        """(correct, samples) of the round by task: each problem's `data_source` (issue 42)."""
        out: dict[str, tuple[int, int]] = {}
        for problem, result in rnd.results.items():
            if problem < len(self.prompts):  # a round of another evaluation set has none
                task = task_label(self.prompts[problem][2])
                correct, samples = out.get(task, (0, 0))
                out[task] = (correct + result.correct, samples + result.samples)
        return out

    def _credit(self, rnd: _Round, metrics: dict[str, float]) -> int:
        """Credit the round to the newest version that produced it: set `eval/step`,
        `eval/rl_seconds` and `eval/policy_version` to its publication; returns the step."""
        newest = int(metrics["eval/policy_version_max"])
        step, rl_seconds = self.publications.get(newest, (rnd.tag.round_step, rnd.tag.rl_seconds))
        metrics["eval/credited_at_issue"] = float(newest not in self.publications)
        metrics |= {
            "eval/step": float(step),
            "eval/rl_seconds": rl_seconds,
            "eval/policy_version": float(newest),
        }
        # Versions older than every round still open can no longer be credited.
        oldest = min((v for v in self.rounds), default=newest)
        for v in [v for v in self.publications if v < min(oldest, newest)]:
            del self.publications[v]
        return step

    def _append_record(self, step: int, rnd: _Round, metrics: dict[str, float]) -> None:
        if self.rounds_path is None:
            return
        record = Round(
            step=step,
            rl_seconds=metrics["eval/rl_seconds"],
            per_problem=tuple(rnd.per_problem),
            policy_version=int(metrics["eval/policy_version"]),
            extra={
                "problems": [i for i in sorted(rnd.results)],
                "samples": rnd.tag.samples,
                "issued_step": rnd.tag.round_step,
                "policy_version_min": int(metrics["eval/policy_version_min"]),
                "acc_ci": [metrics["eval/acc_ci_low"], metrics["eval/acc_ci_high"]],
            },
        )
        self.rounds_path.parent.mkdir(parents=True, exist_ok=True)
        with self.rounds_path.open("a") as f:
            f.write(json.dumps(record.to_json()) + "\n")


def eval_problems(cfg: DapoConfig) -> tuple[list[PromptRecord], Overlap]:
    """The evaluation set every evaluator of a run uses (the lane, `dapo eval`, the in-process
    loop), in one order, so problem i is the same problem everywhere (its seeds too)."""
    d = cfg.data
    assert d.eval_path is not None
    return held_out_problems(
        d.eval_path,
        d.train_path,
        max_problems=cfg.eval.max_problems,
        columns=d.columns,
        key=d.heldout_key,
        drop=d.drop_eval_overlap,
    )


def eval_lane(
    cfg: DapoConfig,
    tokenizer: Any,
    catch_up: Callable[[], None],
    *,
    transport: Transport,
    run_state: RunState,
    job_key: SigningKey | None = None,
) -> Evaluations:
    """Rank 0's lane over `data.eval_path`'s distinct problems, or none without an eval set."""
    if not cfg.data.eval_path:
        return NullEvaluations()
    problems, _ = eval_problems(cfg)
    prompts = [
        (
            encode_prompt(tokenizer, p.messages, cfg.data.max_prompt_len, chat=cfg.data.chat),
            p.ground_truth,
            p.data_source,
        )
        for p in problems
    ]
    return EvalLane(
        prompts,
        transport=transport,
        run_state=run_state,
        run_name=cfg.run_name,
        samples=cfg.eval.samples_per_problem,
        max_deliveries=cfg.queue.max_deliveries,
        catch_up=catch_up,
        extra_infos=[p.extra_info for p in problems],
        rounds_path=Path(cfg.output_dir) / EVAL_ROUNDS_FILE,
        job_key=job_key,
    )
