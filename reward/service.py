"""`dapo reward`: one reward worker. Many can run; each takes whole groups.

For every response of a group: decode the response tokens (special tokens skipped; tool results
left out unless `reward.grade_tool_results`: the model's own words are graded), score them
against the prompt's ground truth with the row's verifier (+1 / -1: `reward.verifier`, or per
`data_source` `reward.verifier_by_source`, or a reasoning-gym row's own task scorer;
`reward.routing`) or the user's `reward.function` (its own score; `reward.custom`), add the
overlong penalty (docs/algorithm.md s2, on the model's tokens) and forward the scored group.
The scalar reward is per response; the learner places it on the response's last token. Verifier
timeouts are counted, never hidden.

A `reward.function` is loaded at start, in the sandbox workers that will run it: one that
cannot be loaded stops the service with a `ConfigError` naming the setting (`dapo run` checks
it the same way, with `check_reward_function`, before it starts anything).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from contracts.bus import Entry, Transport
from contracts.config import ConfigError, DapoConfig, RewardConfig
from contracts.keys import Counter
from contracts.model_source import with_local_model
from contracts.runtime import ServiceContext, StageLoop, serve_stage, service_context
from contracts.schemas import (
    RolloutGroup,
    SchemaError,
    ScoredGroup,
    check_job_signature,
    decode_group,
    encode_group,
)
from contracts.signing import WeightKey, weights_public_key
from reward.custom import RewardFunctionError
from reward.overlong import shaped_reward
from reward.result import VerifyResult
from reward.routing import RoutedScorer, announced_verifiers
from reward.text import model_token_ids
from reward.verifiers import SandboxPool, Scorer, WorkerStartError, make_scorer

log = logging.getLogger(__name__)

REWARD_BATCH = 8
"""Groups a reward worker takes per read."""


def open_scorer(rw: RewardConfig, *, workers: int | None = None, gym: bool = False) -> Scorer:
    """The scorer the reward config asks for, ready to score: `reward.function` for every row,
    else a `RoutedScorer` choosing each row's verifier (`reward.routing.verifier_for`).

    The verifiers the config names (with `gym`, the data comes from `data.gym`: reasoning-gym's
    scorers too) and a `reward.function` are loaded before this returns, so one that cannot be
    used fails here, not on the first group.

    Raises:
        ConfigError: a sandboxed scorer cannot be loaded; the message names the setting.
    """
    n = rw.sandbox_workers if workers is None else workers

    def make(name: str) -> Scorer:
        return make_scorer(name, timeout_s=rw.timeout_s, workers=n, function=rw.function)

    try:  # the sandbox workers load the checker before this returns
        if rw.function is not None:
            scorer = make(rw.verifier)
        else:
            scorer = RoutedScorer(rw, make, start=announced_verifiers(rw, gym=gym))
    except RewardFunctionError as exc:  # malformed; caught before any process starts
        raise ConfigError(str(exc)) from None
    except WorkerStartError as exc:
        message = str(exc)
        if rw.function is not None and "reward.function" not in message:
            message = f"reward.function={rw.function!r}: {message}"
        raise ConfigError(message) from None
    if rw.function is not None and isinstance(scorer, SandboxPool):
        log.info("scoring with reward.function=%r (reward.verifier is not used)", rw.function)
    return scorer


def check_reward_function(cfg: DapoConfig) -> None:
    """Load `reward.function` once in a throw-away sandbox worker, and reasoning-gym's scorers
    when the data comes from `data.gym` (nothing when neither is used).

    Raises:
        ConfigError: one cannot be loaded; the message names the setting and what is wrong.
    """
    if cfg.reward.function is not None:
        open_scorer(cfg.reward, workers=1).close()
    elif cfg.data.gym is not None:
        rw = cfg.reward.model_copy(update={"verifier": "reasoning-gym", "verifier_by_source": {}})
        open_scorer(rw, workers=1).close()


class MetricMeans:
    """Running means of the `metrics` a `reward.function` returns, by name."""

    def __init__(self) -> None:
        self.sums: defaultdict[str, float] = defaultdict(float)
        self.counts: defaultdict[str, int] = defaultdict(int)

    def add(self, results: list[VerifyResult]) -> None:
        for result in results:
            for name, value in result.metrics.items():
                self.sums[name] += value
                self.counts[name] += 1

    def means(self) -> dict[str, float]:
        return {name: self.sums[name] / self.counts[name] for name in sorted(self.sums)}


class RewardStage:
    """The reward stage's worker: scores whole groups, `REWARD_BATCH` at a time."""

    def __init__(
        self,
        cfg: DapoConfig,
        tokenizer: Any,
        *,
        transport: Transport,
        job_key: WeightKey | None = None,
    ) -> None:
        """`transport`: the only part of the bus a reward stage touches (it reads, hops and
        dead-letters). `job_key`: the learner's public key; a group whose job it does not verify
        is dead-lettered unscored (None: unchecked, for a worker built by hand)."""
        self.cfg, self.transport, self.tokenizer = cfg, transport, tokenizer
        self.job_key = job_key
        self.scorer = open_scorer(cfg.reward, gym=cfg.data.gym is not None)
        self.groups = 0
        self.timeouts = 0
        self.unverified = 0
        self.metrics = MetricMeans()

    @property
    def loop(self) -> StageLoop:
        return StageLoop(self.transport.keys.rollouts, batch=REWARD_BATCH)

    def close(self) -> None:
        self.scorer.close()

    def status(self) -> dict[str, Any]:
        return {
            "groups": self.groups,
            "timeouts": self.timeouts,
            "unverified": self.unverified,
            "metrics": self.metrics.means(),
        }

    def handle(self, entries: list[Entry]) -> None:
        stage = self.transport.keys.rollouts
        max_len = self.cfg.rollout.max_response_len
        for entry_id, fields in entries:
            try:
                group = decode_group(fields)
            except SchemaError as exc:
                self.transport.dead_letter(stage, entry_id, fields, f"reward: {exc}")
                continue
            if self.job_key is not None:  # a prompt or an answer chosen by someone else
                try:
                    check_job_signature(group, self.job_key)
                except SchemaError as exc:  # not one of our jobs: the ledger never counted it
                    self.transport.dead_letter(
                        stage, entry_id, fields, f"reward: {exc}", foreign=True
                    )
                    continue
            longest = max(r.model_tokens for r in group.responses)  # tool results excepted
            # No sampler produces this; the overlong penalty is unbounded past it.
            if longest > max_len:
                self.transport.dead_letter(
                    stage,
                    entry_id,
                    fields,
                    f"reward: a response of {longest} tokens exceeds "
                    f"rollout.max_response_len={max_len} (services running with different "
                    "configs?)",
                )
                continue
            scored, results = score_group(group, self.tokenizer, self.scorer, self.cfg)
            self.metrics.add(results)
            self.unverified += sum(r.reason is not None for r in results)
            self.timeouts += scored.reward_timeouts
            if scored.reward_timeouts:
                self.transport.incr(Counter.REWARD_TIMEOUTS, scored.reward_timeouts)
            self.groups += self.transport.hop(
                stage,
                entry_id,
                downstream=self.transport.keys.scored.stream,
                fields=encode_group(scored),
            )


def score_group(
    group: RolloutGroup, tokenizer: Any, scorer: Scorer, cfg: DapoConfig
) -> tuple[ScoredGroup, list[VerifyResult]]:
    """Judge a group: its scores, accuracies, predictions and shaped rewards.

    Returns the scored group and the verifier's results, one per response (for their reasons
    and metrics). Each response's `text` becomes the tail of its decoded text, for inspection.
    """
    ov, max_len = cfg.reward.overlong, cfg.rollout.max_response_len
    graded = [
        r.token_ids if cfg.reward.grade_tool_results else model_token_ids(r.token_ids, r.tool_spans)
        for r in group.responses
    ]
    texts = tokenizer.batch_decode(graded, skip_special_tokens=True)
    job = group.job
    results = scorer.score_many(
        [(t, job.ground_truth) for t in texts],
        [job.extra_info] * len(texts),
        [job.data_source] * len(texts),
    )
    rewards = [
        shaped_reward(
            r.score,
            resp.model_tokens,  # tool results inserted in the response are not the model's
            max_len=max_len,
            buffer_len=ov.buffer_len,
            factor=ov.penalty_factor,
            enabled=ov.enabled,
        )
        for r, resp in zip(results, group.responses, strict=True)
    ]
    for resp, text in zip(group.responses, texts, strict=True):
        resp.text = text[-200:]  # the graded text's tail, for inspection; the verifier saw it all
    scored = ScoredGroup.of(
        group,
        scores=[r.score for r in results],
        acc=[r.acc for r in results],
        rewards=rewards,
        preds=[r.pred for r in results],
        reward_timeouts=sum(r.timeout for r in results),
    )
    unverified = [r.reason for r in results if r.reason is not None]
    if unverified:  # pred says only "[ERROR]" / "[TIMEOUT]"; the reason goes here
        log.warning(
            "group %s: %d responses not verified: %s",
            group.job.group_id,
            len(unverified),
            "; ".join(sorted(set(unverified))),
        )
    return scored, results


def build_stage(cfg: DapoConfig, ctx: ServiceContext) -> RewardStage:
    """The reward stage as every host builds it (`dapo reward`; Ray Serve's `RewardHost`): the
    model's tokenizer (overlong shaping counts its tokens), the learner's public key (only jobs
    it signed are scored)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    return RewardStage(cfg, tokenizer, transport=ctx.bus, job_key=weights_public_key())


def main(cfg: DapoConfig) -> int:
    cfg = with_local_model(cfg)  # an hf:// model: its snapshot (the tokenizer) in the HF cache
    ctx = service_context(cfg, "reward")
    serve_stage(ctx, build_stage(cfg, ctx), cfg.queue)
    return 0
