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

Replicas may already hold a newer policy than the round's (generation is asynchronous). An
evaluation job takes no in-flight weight update, so each result's responses come from one
version, which it records (`EvalResult.policy_version_min` / `_max`); the round reports the
versions it measured: `eval/policy_version_max` (the newest, the policy the accuracy belongs to
when the round is uniform), `eval/policy_version_min`, and `eval/policy_version_lag` (the newest
minus the version the round was issued for). A round whose min and max differ mixed policies
(replicas at different versions); its log line names the range.

A round that lost jobs to the dead-letter stream is reported once the whole evaluation lane has
nothing left in flight, over the problems it has (`eval/problems`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from contracts.bus import Entry, StreamBus
from contracts.config import DapoConfig
from contracts.data import encode_prompt, load_eval_problems
from contracts.keys import LEDGER_EVALUATED
from contracts.schemas import (
    EvalResult,
    EvalTag,
    PromptJob,
    SchemaError,
    decode_eval_result,
    encode_job,
)
from learner.commands import Progress

log = logging.getLogger(__name__)

RoundReport = tuple[int, dict[str, float]]
"""(the step whose weights were evaluated, its eval metrics)."""


class Evaluations(Protocol):
    @property
    def in_flight(self) -> bool:
        """Some evaluation job is still being generated, scored or added up."""
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

    def metrics(self, issued_at: float | None) -> dict[str, float]:
        results = list(self.results.values())
        samples = sum(r.samples for r in results)
        out = {
            "eval/acc": sum(r.correct for r in results) / samples,
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
        bus: StreamBus,
        prompts: list[tuple[list[int], str, str]],
        *,
        run_name: str,
        samples: int,
        max_deliveries: int,
        catch_up: Callable[[], None],
        extra_infos: list[dict[str, Any]] | None = None,
    ) -> None:
        """prompts: (prompt ids, ground truth, data source) per distinct problem; extra_infos: each
        problem's data-row `extra_info` (for a `reward.function`), or None for none."""
        self.bus, self.prompts, self.run_name, self.samples, self.catch_up = (
            bus,
            prompts,
            run_name,
            samples,
            catch_up,
        )
        self.extra_infos = extra_infos
        # Rounds are keyed by the policy version they evaluate: versions never repeat, while a
        # step can (a learner that resumes from an older checkpoint retrains it).
        self.rounds: dict[int, _Round] = {}
        self.issued_at: dict[int, float] = {}
        self.finished: set[int] = set()
        # Only one learner runs at a time: results pending in the stream were held by a previous
        # incarnation for rounds it had not finished. Take them over.
        self.taken_over: list[Entry] = bus.reclaim(
            bus.keys.evals, min_idle_s=0.0, max_deliveries=max_deliveries, count=1_000_000
        )

    @property
    def in_flight(self) -> bool:
        return bool(self.rounds) or self.bus.ledger().eval_in_flight > 0

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
                )
            )
            for i, (ids, truth, source) in enumerate(self.prompts)
        ]
        self.bus.issue(jobs, evaluation=True)
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
            self.taken_over + self.bus.read(self.bus.keys.evals, count=100_000, block_ms=None),
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
        stage = self.bus.keys.evals
        try:
            result = decode_eval_result(fields)
        except SchemaError as exc:
            self.bus.dead_letter(stage, entry_id, fields, f"learner: {exc}")
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
            self.bus.hop(stage, entry_id, outcome=LEDGER_EVALUATED)
            return
        rnd.results[result.tag.problem] = result
        rnd.entry_ids.append(entry_id)

    def _lane_quiet(self) -> bool:
        """Every evaluation job still in flight is a result held here: nothing more will come."""
        held = sum(len(r.entry_ids) for r in self.rounds.values())
        return self.bus.ledger().eval_in_flight == held

    def _finish(self, version: int) -> RoundReport:
        rnd = self.rounds.pop(version)
        for entry_id in rnd.entry_ids:
            self.bus.hop(self.bus.keys.evals, entry_id, outcome=LEDGER_EVALUATED)
        self.finished.add(version)
        step, metrics = rnd.tag.round_step, rnd.metrics(self.issued_at.pop(version, None))
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
        return step, metrics


def eval_lane(
    bus: StreamBus, cfg: DapoConfig, tokenizer: Any, catch_up: Callable[[], None]
) -> Evaluations:
    """Rank 0's lane over `data.eval_path`'s distinct problems, or none without an eval set."""
    if not cfg.data.eval_path:
        return NullEvaluations()
    problems = load_eval_problems(
        cfg.data.eval_path, cfg.eval.max_problems, columns=cfg.data.columns
    )
    prompts = [
        (
            encode_prompt(tokenizer, p.messages, cfg.data.max_prompt_len),
            p.ground_truth,
            p.data_source,
        )
        for p in problems
    ]
    return EvalLane(
        bus,
        prompts,
        run_name=cfg.run_name,
        samples=cfg.eval.samples_per_problem,
        max_deliveries=cfg.queue.max_deliveries,
        catch_up=catch_up,
        extra_infos=[p.extra_info for p in problems],
    )
