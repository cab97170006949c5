"""Dynamic sampling (docs/algorithm.md section 6) as a stream stage: `dapo gatekeeper`.

Reads scored groups, keeps a group only if its metric (default `acc`, not the shaped reward)
differs across the group's responses, and forwards kept groups to the train stream. A dropped
group is counted `filtered` in the ledger; the learner's feeder sees the shortfall and issues
replacement prompts, so a high filter rate slows the run down but never stops it.

A group that does not decode, arrives unscored, or carries numbers no model could train on (NaN
or infinite rewards or log-probs, positive log-probs, negative token ids: the schema's decode
checks them) is dead-lettered with the reason (counted `dead` in the ledger) and never forwarded.

Evaluation groups (`PromptJob.eval`) are never gated or trained: the gatekeeper reduces each to
an `EvalResult` (counts only) and forwards it to the evaluation lane, where learner rank 0 adds
up each round.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from contracts.bus import Entry, StreamBus
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

    def __init__(self, bus: StreamBus, *, metric: str = "acc", enabled: bool = True) -> None:
        self.bus, self.metric, self.enabled = bus, metric, enabled
        self.kept = 0
        self.filtered = 0
        self.evaluations = 0

    @property
    def pass_rate(self) -> float:
        seen = self.kept + self.filtered
        return self.kept / seen if seen else 0.0

    @property
    def loop(self) -> StageLoop:
        return StageLoop(self.bus.keys.scored, batch=GATE_BATCH)

    def status(self) -> dict[str, Any]:
        return {
            "kept": self.kept,
            "filtered": self.filtered,
            "pass_rate": round(self.pass_rate, 4),
            "evaluations": self.evaluations,
        }

    def close(self) -> None:
        pass

    def handle(self, entries: list[Entry]) -> None:
        stage = self.bus.keys.scored
        for entry_id, fields in entries:
            try:
                group = decode_scored_group(fields)
            except SchemaError as exc:
                self.bus.dead_letter(stage, entry_id, fields, f"gatekeeper: {exc}")
                continue
            if group.job.eval is not None:
                result = encode_eval_result(EvalResult.of(group))
                self.evaluations += self.bus.hop(
                    stage, entry_id, downstream=self.bus.keys.evals.stream, fields=result
                )
                continue
            informative = keep_group(group_metric(group, self.metric))
            if not self.enabled or informative:
                done = self.bus.hop(
                    stage,
                    entry_id,
                    downstream=self.bus.keys.train.stream,
                    fields={k.decode(): v for k, v in fields.items()},
                    counter=Counter.GATEKEEPER_KEPT,
                )
                self.kept += done
            else:
                done = self.bus.hop(stage, entry_id, outcome=LEDGER_FILTERED)
                self.filtered += done
            if done:
                self._count_responses(group)
                self._record_history(group, informative)

    def _count_responses(self, group: ScoredGroup) -> None:
        """Response counts for the truncation rate, added after the hop rather than inside its
        atomic script: they are a statistic, so a crash in between may undercount one group,
        and the hop, which the ledger rests on, stays as simple as it is."""
        self.bus.incr(Counter.RESPONSES_JUDGED, len(group.responses))
        self.bus.incr(
            Counter.RESPONSES_TRUNCATED,
            sum(r.finish_reason == "length" for r in group.responses),
        )

    def _record_history(self, group: ScoredGroup, informative: bool) -> None:
        """The prompt's record in the run's prompt history (after the hop, like the counts):
        whether this group carried learning signal, which is what the gatekeeper keeps, even
        when it is switched off and trains every group. A group without signal is also counted
        easy (every response right) or hard: prompt skipping steers each kind's keep
        probability by its share of the groups decided (docs/algorithm.md section 11)."""
        job = group.job
        correct, size = sum(bool(a) for a in group.acc), len(group.acc)
        self.bus.record_prompt_outcome(
            job.prompt_index, epoch=job.epoch, correct=correct, size=size, kept=informative
        )
        if not informative:
            easy = 0 < size == correct
            self.bus.incr(Counter.ZERO_ADVANTAGE_EASY if easy else Counter.ZERO_ADVANTAGE_HARD)


def main(cfg: DapoConfig) -> int:
    ctx = service_context(cfg, "gatekeeper")
    gate = Gatekeeper(
        ctx.bus, metric=cfg.algorithm.gatekeeper_metric, enabled=cfg.algorithm.gatekeeper
    )
    serve_stage(ctx, gate, cfg.queue)
    log.info("gatekeeper stopped: kept %d, filtered %d", gate.kept, gate.filtered)
    return 0
