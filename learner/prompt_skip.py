"""Prompt skipping's rule (`algorithm.prompt_skip`, docs/algorithm.md section 11), after GRESO
(Zheng et al. 2025, "Act Only When It Pays"): pure functions of a prompt's history and of the
run's two base keep probabilities, and the state that carries the bases from one training step
to the next. The feeder (`learner/feeder.py`) reads the history and stores the state in Redis.

Departures from GRESO's reference code: the floor `min_keep` is 0.05 (0.01 there) and p_hard
starts above p_easy (both 0.5 there), both settings; a "step" is a change of the learner's policy
version seen at an admission, and its window is the groups the gatekeeper decided meanwhile (an
asynchronous run has no rollout batch per step; a step during which the feeder was not asked to
admit joins the next one's window).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


def keep_probability(
    easy_streak: int, hard_streak: int, *, keep_easy: float, keep_hard: float, min_keep: float
) -> float:
    """Probability of issuing a prompt whose latest groups carried no learning signal:
    keep_easy ** easy_streak after that many all-right groups in a row, keep_hard ** hard_streak
    after all-wrong ones (at most one streak is non-zero), never below the floor `min_keep`;
    1 with no streak."""
    if easy_streak:
        return max(min_keep, keep_easy**easy_streak)
    if hard_streak:
        return max(min_keep, keep_hard**hard_streak)
    return 1.0


def adapt_keep_base(
    keep: float, share: float, target: float, *, step: float, low: float, high: float
) -> float:
    """GRESO's controller for one kind: `share` of the step's decided groups were of this kind;
    at or above `target` skip more of them next step (keep - step), below it explore more
    (keep + step). Always within [low, high], also from a `keep` outside them (a restarted run
    whose bounds changed)."""
    moved = keep - step if share >= target else keep + step
    return min(high, max(low, moved))


@dataclass(frozen=True)
class Decided:
    """The run's counts of gatekeeper decisions (training lane), as the counters hold them."""

    groups: int
    """Every decided group, kept or filtered."""
    easy: int
    """Of them, without signal and every response right (`zero_advantage_easy`)."""
    hard: int
    """Without signal otherwise (`zero_advantage_hard`)."""

    def since(self, before: Decided) -> Decided | None:
        """The decisions made after `before`; None when a count went back (Redis restarted
        without its data, so the counts started over and the difference means nothing)."""
        delta = Decided(
            self.groups - before.groups, self.easy - before.easy, self.hard - before.hard
        )
        return None if min(delta.groups, delta.easy, delta.hard) < 0 else delta


@dataclass(frozen=True)
class SkipState:
    """The adapted bases, and where the current step's window starts (run info `prompt_skip`)."""

    keep_easy: float
    keep_hard: float
    policy_version: int
    """The version the window was opened at; the next version closes it."""
    opened: Decided
    """The counts when the window was opened."""

    def step(
        self,
        policy_version: int,
        now: Decided,
        *,
        adapt: bool,
        easy_target: float,
        hard_target: float,
        step: float,
        low: float,
        high: float,
    ) -> SkipState:
        """Close the window at a new `policy_version` and open the next at `now`. With `adapt`
        (GRESO: not in the first data epoch) and decisions in the window, each base moves one
        step toward holding its kind's share of them at its target."""
        keep_easy, keep_hard = self.keep_easy, self.keep_hard
        window = now.since(self.opened)
        if adapt and window is not None and window.groups > 0:
            bounds = {"step": step, "low": low, "high": high}
            keep_easy = adapt_keep_base(
                keep_easy, window.easy / window.groups, easy_target, **bounds
            )
            keep_hard = adapt_keep_base(
                keep_hard, window.hard / window.groups, hard_target, **bounds
            )
        return SkipState(keep_easy, keep_hard, policy_version, now)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SkipState:
        """Raises ValueError (or TypeError, KeyError) on anything `to_json` did not write."""
        raw = json.loads(text)
        state = cls(
            float(raw["keep_easy"]),
            float(raw["keep_hard"]),
            int(raw["policy_version"]),
            Decided(**{k: int(v) for k, v in raw["opened"].items()}),
        )
        if not all(0 < p <= 1 for p in (state.keep_easy, state.keep_hard)):
            raise ValueError(f"keep probabilities out of (0, 1]: {raw}")
        return state
