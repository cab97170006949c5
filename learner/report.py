"""What the learner reports each step: the metrics record in Redis (read by the API and `dapo
run`), the trackers (TensorBoard, W&B), one log line, and the evaluation history; every
`tracking.log_completions_every` steps, a sample of the step's completions, decoded.

Metric names follow verl's where one exists (`critic/rewards/mean`, `response_length/mean`,
`timing_s/update_actor`, ...); per-task ones (issue 42) are `task/<name>/accuracy`,
`/pass_rate`, `/response_length` (the groups the gatekeeper decided since the last step) and
`/eval_acc` (each evaluation round). Other ranks hold `NullReporter`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from contracts.bus import RunState, Telemetry, Transport
from contracts.config import TrackingConfig
from contracts.keys import RunField
from contracts.schemas import ScoredGroup
from contracts.tasks import step_task_metrics
from learner.commands import Progress
from learner.tracking import Completion, Tracker

log = logging.getLogger(__name__)


class Reporter(Protocol):
    @property
    def has_evals(self) -> bool: ...

    @property
    def mean_version_lag(self) -> float: ...

    def rollout_metrics(
        self, groups: Sequence[ScoredGroup], trained_on: int
    ) -> dict[str, float]: ...

    def record_eval(self, step: int, result: dict[str, float]) -> None: ...

    def rewrite_eval_history(self) -> None: ...

    def report(self, progress: Progress, metrics: dict[str, float]) -> None: ...

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NullReporter:
    """Ranks other than 0 report nothing (rank 0's metrics are already averaged over ranks)."""

    has_evals = True  # nothing to evaluate here: the base evaluation is rank 0's
    mean_version_lag = 0.0

    def rollout_metrics(self, groups: Sequence[ScoredGroup], trained_on: int) -> dict[str, float]:
        return {}

    def record_eval(self, step: int, result: dict[str, float]) -> None:
        pass

    def rewrite_eval_history(self) -> None:
        pass

    def report(self, progress: Progress, metrics: dict[str, float]) -> None:
        pass

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def group_metrics(groups: Sequence[ScoredGroup], trained_on: int) -> dict[str, float]:
    """Batch statistics of the groups trained on at policy version `trained_on`."""
    rewards = [r for g in groups for r in g.rewards]
    scores = [s for g in groups for s in g.scores]
    accs = [float(a) for g in groups for a in g.acc]
    # The model's tokens: a tool's result is context it read, not length it wrote
    # (docs/algorithm.md s12); `rollout/tokens` counts every token the learner processes.
    lengths = [r.model_tokens for g in groups for r in g.responses]
    lags = [float(trained_on - g.policy_version) for g in groups]
    truncated = sum(r.finish_reason == "length" for g in groups for r in g.responses)
    spans = [
        r.versions[1] - r.versions[0] for g in groups for r in g.responses if r.versions is not None
    ]
    gen = [g.gen_seconds for g in groups]
    calls = [float(r.tool_calls) for g in groups for r in g.responses]
    return {
        "critic/rewards/mean": _mean(rewards),
        "critic/score/mean": _mean(scores),
        "rollout/acc_mean": _mean(accs),
        "response_length/mean": _mean(lengths),
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": truncated / max(len(lengths), 1),
        "rollout/version_lag_mean": _mean(lags),
        "rollout/updated_in_flight": _mean(
            [float(span > 0) for span in spans]
        ),  # sampled by 2+ versions
        "rollout/tokens": float(sum(len(r.token_ids) for g in groups for r in g.responses)),
        "rollout/groups": float(len(groups)),
        # A replica's generation time for the batch the group came in, per group of that batch:
        # the generation rate `dapo plan --calibrate` reads back.
        "timing_s/gen_per_group": _mean(gen),
        # Tool use (`rollout.tools`; all 0 without it). Turns: the model's spans, calls + 1.
        "tools/calls_per_response": _mean(calls),
        "tools/call_rate": _mean([float(c > 0) for c in calls]),
        "tools/turns_mean": _mean([c + 1 for c in calls]),
        "tools/errors": float(sum(r.tool_errors for g in groups for r in g.responses)),
        "tools/timeouts": float(sum(r.tool_timeouts for g in groups for r in g.responses)),
        "timing_s/tools": sum(r.tool_seconds for g in groups for r in g.responses),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class CompletionSampler:
    """Every `every` steps, `count` of the step's completions, decoded: one response from each of
    the first groups, then a second from each, and so on. The sample is what was trained on, so
    it shows only groups the gatekeeper kept (never the all-correct or all-wrong ones)."""

    def __init__(self, decode: Callable[[list[int]], str], *, every: int, count: int) -> None:
        self.decode, self.every, self.count = decode, every, count

    @classmethod
    def from_config(
        cls, tracking: TrackingConfig, decode: Callable[[list[int]], str]
    ) -> CompletionSampler:
        return cls(decode, every=tracking.log_completions_every, count=tracking.completions_per_log)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def sample(self, groups: Sequence[ScoredGroup]) -> list[Completion]:
        picked: list[Completion] = []
        for i in range(min(self.count, sum(len(g.responses) for g in groups))):
            group = groups[i % len(groups)]
            k = i // len(groups)
            if k >= len(group.responses):  # groups of unequal size: this one has run out
                continue
            response = group.responses[k]
            picked.append(
                Completion(
                    prompt=self.decode(group.job.prompt_ids),
                    response=self.decode(response.token_ids),
                    reward=group.rewards[k],
                    acc=group.acc[k],
                    finish_reason=response.finish_reason,
                )
            )
        return picked


class RunReporter:
    """Rank 0: metrics stream, trackers, log line, evaluation history, completion samples."""

    def __init__(
        self,
        trackers: Tracker,
        completions: CompletionSampler | None = None,
        *,
        transport: Transport,
        run_state: RunState,
        telemetry: Telemetry,
    ) -> None:
        # The parts of the bus it reads and writes: `transport` (the ledger, stream depths),
        # `run_state` (evaluation history, run info) and `telemetry` (metrics, task counts).
        self.transport, self.run_state, self.telemetry = transport, run_state, telemetry
        self.trackers, self.completions = trackers, completions
        self.evals: list[tuple[int, float, float]] = run_state.eval_history()
        self.task_evals: list[tuple[int, dict[str, float]]] = run_state.task_eval_history()
        self.task_counts = telemetry.task_stats()
        """Each task's counts as of the last step (`rollout_metrics` reports the difference)."""
        self.lags: list[float] = []
        self.step_groups: Sequence[ScoredGroup] = ()
        """The groups of the step being reported: `rollout_metrics` sees them,
        `report` samples them."""

    @property
    def has_evals(self) -> bool:
        return bool(self.evals)

    @property
    def mean_version_lag(self) -> float:
        return _mean(self.lags)

    def rollout_metrics(self, groups: Sequence[ScoredGroup], trained_on: int) -> dict[str, float]:
        """The batch's statistics plus the pipeline's: gatekeeper, ledger, stream depths."""
        metrics = group_metrics(groups, trained_on)
        self.step_groups = groups
        self.lags.append(
            metrics["rollout/version_lag_mean"]
        )  # every step trains the same number of groups
        ledger = self.transport.ledger()
        rate = self.transport.pass_rate(ledger.filtered)
        tasks, self.task_counts = self.task_counts, self.telemetry.task_stats()
        return {
            **metrics,
            # Each task over the groups the gatekeeper decided since the last step, filtered ones
            # included: the batch's own figures above see only the kept groups.
            **step_task_metrics(self.task_counts, tasks),
            **{f"depth/{stage}": float(n) for stage, n in self.transport.depths().items()},
            "gate/pass_rate": 0.0 if rate is None else rate,
            "gate/filtered_total": float(ledger.filtered),
            "ledger/issued": float(ledger.issued),
            "ledger/in_flight": float(ledger.in_flight),
            "ledger/eval_in_flight": float(ledger.eval_in_flight),
        }

    def record_eval(self, step: int, result: dict[str, float]) -> None:
        self.evals.append((step, result["eval/acc"], result.get("eval/rl_seconds", -1.0)))
        tasks = {
            key.split("/")[1]: value
            for key, value in result.items()
            if key.startswith("task/") and key.endswith("/eval_acc")
        }
        if tasks:
            self.task_evals.append((step, tasks))
        self.trackers.log(step, result)
        self.rewrite_eval_history()

    def rewrite_eval_history(self) -> None:
        self.run_state.update_run_info(
            {
                RunField.EVAL_HISTORY: json.dumps(self.evals),
                RunField.TASK_EVAL_HISTORY: json.dumps(self.task_evals),
            }
        )

    def report(self, progress: Progress, metrics: dict[str, float]) -> None:
        record = {
            "step": progress.step,
            "policy_version": progress.policy_version,
            "time": time.time(),
            **metrics,
        }
        self.telemetry.append_metrics(record)
        self.trackers.log(progress.step, metrics)
        if (
            self.completions is not None
            and self.completions.due(progress.step)
            and self.step_groups
        ):
            self.trackers.log_completions(progress.step, self.completions.sample(self.step_groups))
        self.step_groups = ()
        log.info(
            "step %d v%d reward %.3f acc %.3f pass %.2f lag %.2f clip %.3f/%.3f kl %.4f",
            progress.step,
            progress.policy_version,
            metrics.get("critic/rewards/mean", 0),
            metrics.get("rollout/acc_mean", 0),
            metrics.get("gate/pass_rate", 0),
            metrics.get("rollout/version_lag_mean", 0),
            metrics.get("actor/clipfrac_high", 0),
            metrics.get("actor/clipfrac_low", 0),
            metrics.get("actor/ppo_kl", 0),
        )

    def checkpoint_meta(self) -> dict[str, Any]:
        last = self.telemetry.last_metrics()
        kept = ("eval/", "critic/rewards", "critic/score", "rollout/acc")
        return {
            "eval_history": self.evals,
            "metrics": {k: v for k, v in last.items() if k.startswith(kept)},
        }

    def close(self) -> None:
        self.trackers.close()
