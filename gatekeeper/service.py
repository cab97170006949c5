"""Dynamic sampling (docs/algorithm.md section 6) as a stream stage: `dapo gatekeeper`.

Reads scored groups, keeps a group only if its metric (default `acc`, not the shaped reward)
differs across the group's responses, and forwards kept groups to the train stream. A dropped
group is counted `filtered` in the ledger; the learner's feeder sees the shortfall and issues
replacement prompts, so a high filter rate slows the run down but never stops it.

A group that does not decode, arrives unscored, or carries numbers no model could train on (NaN
or infinite rewards or log-probs, positive log-probs, negative token ids: the schema's decode
checks them) is dead-lettered with the reason (counted `dead` in the ledger) and never forwarded.

Each decided group is also counted under its task (its job's `data_source`, issue 42): kept or
filtered, responses right, responses and their tokens (`contracts.tasks.TaskStats`), from which
the learner, the API and the run summary report each task's accuracy, pass rate and length.

Evaluation groups (`PromptJob.eval`) are never gated or trained: the gatekeeper reduces each to
an `EvalResult` (its signed job and counts) and forwards it to the evaluation lane, where learner
rank 0 adds up each round.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from contracts.bus import Entry, PromptHistory, RunState, Telemetry, Transport
from contracts.config import DapoConfig
from contracts.keys import LEDGER_FILTERED, Counter
from contracts.runtime import StageLoop, serve_stage, service_context
from contracts.schemas import (
    EvalResult,
    SchemaError,
    ScoredGroup,
    decode_scored_group,
    encode_eval_result,
)
from contracts.tasks import MAX_TASKS, OTHER_TASK, TaskStats, task_label

log = logging.getLogger(__name__)


def keep_group(values: Sequence[float | bool | int]) -> bool:
    """True when a group carries learning signal: its metric is not identical across the group.

    values: the metric of each response of one group, shape [G].
    A single-response group is always kept (docs/algorithm.md s6). NaN never counts as variance:
    NaNs are ignored, and a group whose values are all NaN is dropped.
    """
    if len(values) == 1:
        return True
    finite = [float(v) for v in values if not (isinstance(v, float) and math.isnan(v))]
    if not finite:
        return False
    return max(finite) != min(finite)


def group_metric(group: ScoredGroup, metric: str) -> list[float]:
    """The per-response values the gatekeeper compares."""
    if metric == "acc":
        return [float(a) for a in group.acc]
    if metric == "score":
        return list(group.scores)
    if metric == "reward":
        return list(group.rewards)
    raise ValueError(f"unknown gatekeeper metric {metric!r}; expected acc, score or reward")


GATE_BATCH = 32
"""Groups per read: deciding is cheap, so the gatekeeper takes many at a time."""


class Gatekeeper:
    """The stage handler: decide, then hop each group to `train` or count it as filtered."""

    def __init__(
        self,
        *,
        transport: Transport,
        run_state: RunState,
        telemetry: Telemetry,
        prompt_history: PromptHistory,
        metric: str = "acc",
        enabled: bool = True,
    ) -> None:
        """The parts of the bus the gatekeeper touches: `transport` (groups in, kept ones out,
        filtered ones counted), `run_state` (the published policy version, which bounds what a
        group may claim), `telemetry` (per-task and response counts) and `prompt_history` (how
        each prompt's group fared, for prompt skipping)."""
        self.transport, self.run_state = transport, run_state
        self.telemetry, self.prompt_history = telemetry, prompt_history
        self.metric, self.enabled = metric, enabled
        self.kept = 0
        self.filtered = 0
        self.evaluations = 0
        self.task_decisions: dict[str, list[int]] = {}
        """This instance's [kept, filtered] groups by task (the run's are in Redis)."""
        self._tasks: set[str] | None = None

    @property
    def pass_rate(self) -> float:
        seen = self.kept + self.filtered
        return self.kept / seen if seen else 0.0

    @property
    def loop(self) -> StageLoop:
        return StageLoop(self.transport.keys.scored, batch=GATE_BATCH)

    def status(self) -> dict[str, Any]:
        return {
            "kept": self.kept,
            "filtered": self.filtered,
            "pass_rate": round(self.pass_rate, 4),
            "evaluations": self.evaluations,
            "task_pass_rate": {
                task: round(kept / (kept + filtered), 4)
                for task, (kept, filtered) in sorted(self.task_decisions.items())
            },
        }

    def close(self) -> None:
        pass

    def handle(self, entries: list[Entry]) -> None:
        stage = self.transport.keys.scored
        published = self.run_state.published_policy_version()
        for entry_id, fields in entries:
            try:
                group = decode_scored_group(fields)
            except SchemaError as exc:
                self.transport.dead_letter(stage, entry_id, fields, f"gatekeeper: {exc}")
                continue
            # Replicas take a version only after the learner publishes it, so a group newer
            # than that (one version of slack for a publication racing this read) was not
            # generated by our weights: the learner would take it as on-policy.
            if published is not None and group.policy_version > published + 1:
                reason = (
                    f"generated by version {group.policy_version}, past the published {published}"
                )
                self.transport.dead_letter(stage, entry_id, fields, f"gatekeeper: {reason}")
                continue
            if group.job.eval is not None:
                result = encode_eval_result(EvalResult.of(group))
                self.evaluations += self.transport.hop(
                    stage, entry_id, downstream=self.transport.keys.evals.stream, fields=result
                )
                continue
            informative = keep_group(group_metric(group, self.metric))
            if not self.enabled or informative:
                done = self.transport.hop(
                    stage,
                    entry_id,
                    downstream=self.transport.keys.train.stream,
                    fields={k.decode(): v for k, v in fields.items()},
                    counter=Counter.GATEKEEPER_KEPT,
                )
                self.kept += done
            else:
                done = self.transport.hop(stage, entry_id, outcome=LEDGER_FILTERED)
                self.filtered += done
            if done:
                self._count_responses(group)
                self._count_task(group, kept=not self.enabled or informative)
                self._record_history(group, informative)

    def _count_responses(self, group: ScoredGroup) -> None:
        """Response counts for the truncation rate, added after the hop rather than inside its
        atomic script: they are a statistic, so a crash in between may undercount one group,
        and the hop, which the ledger rests on, stays as simple as it is."""
        self.telemetry.incr(Counter.RESPONSES_JUDGED, len(group.responses))
        self.telemetry.incr(
            Counter.RESPONSES_TRUNCATED,
            sum(r.finish_reason == "length" for r in group.responses),
        )

    def _count_task(self, group: ScoredGroup, *, kept: bool) -> None:
        """The group's counts under its task (its job's `data_source`), after the hop like the
        response counts: per-task accuracy, pass rate and response length (issue 42)."""
        task = self._task(group.job.data_source)
        decisions = self.task_decisions.setdefault(task, [0, 0])
        decisions[0 if kept else 1] += 1
        stats = TaskStats(
            kept=int(kept),
            filtered=int(not kept),
            correct=sum(bool(a) for a in group.acc),
            responses=len(group.responses),
            tokens=sum(r.model_tokens for r in group.responses),
        )
        self.telemetry.count_task(task, stats)

    def _task(self, data_source: str) -> str:
        """The task a group is counted under: its `data_source`'s label, or `OTHER_TASK` once the
        run has `MAX_TASKS` (a file whose rows each name their own source stays bounded)."""
        if self._tasks is None:
            self._tasks = set(self.telemetry.task_stats())
        task = task_label(data_source)
        if task not in self._tasks:
            if len(self._tasks) >= MAX_TASKS:
                return OTHER_TASK
            self._tasks.add(task)
        return task

    def _record_history(self, group: ScoredGroup, informative: bool) -> None:
        """The prompt's record in the run's prompt history (after the hop, like the counts):
        whether this group carried learning signal, which is what the gatekeeper keeps, even
        when it is switched off and trains every group. A group without signal is also counted
        easy (every response right) or hard: prompt skipping steers each kind's keep
        probability by its share of the groups decided (docs/algorithm.md section 11)."""
        job = group.job
        correct, size = sum(bool(a) for a in group.acc), len(group.acc)
        self.prompt_history.record_prompt_outcome(
            job.prompt_index,
            data_epoch=job.data_epoch,
            correct=correct,
            size=size,
            kept=informative,
        )
        if not informative:
            easy = 0 < size == correct
            counter = Counter.ZERO_ADVANTAGE_EASY if easy else Counter.ZERO_ADVANTAGE_HARD
            self.telemetry.incr(counter)


def main(cfg: DapoConfig) -> int:
    ctx = service_context(cfg, "gatekeeper")
    bus = ctx.bus
    gate = Gatekeeper(
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        metric=cfg.algorithm.gatekeeper_metric,
        enabled=cfg.algorithm.gatekeeper,
    )
    serve_stage(ctx, gate, cfg.queue)
    log.info("gatekeeper stopped: kept %d, filtered %d", gate.kept, gate.filtered)
    return 0
