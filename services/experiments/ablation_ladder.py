"""The rungs of `dapo ablate`'s ladder and the overrides that configure each of its runs:
naive GRPO (`NAIVE_GRPO`) plus one technique per rung (`LADDER`), cumulative and in the
paper's order (`rung_overrides`), and what a seed changes (`seed_overrides`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    key: str
    """Directory name and table key."""
    label: str
    adds: dict[str, str]
    """The overrides this rung adds to the one before it."""
    why: str
    """What the technique should change on a task that exercises it."""


NAIVE_GRPO = {
    "algorithm.clip_high": "0.2",  # symmetric clip: epsilon_high = epsilon_low
    "algorithm.loss_agg": "seq-mean-token-mean",  # sample-level loss
    "algorithm.gatekeeper": "false",  # no dynamic sampling
    "reward.overlong.enabled": "false",  # no soft overlong punishment
    "reward.overlong.filter": "false",  # no overlong filtering
}
"""GRPO as the paper's first row: symmetric clip 0.2, sample-level loss, every group trained,
truncated responses scored like any other. Everything else (no KL, the +-1 rule reward, the
learning rate, batch sizes) stays the config's."""

LADDER: tuple[Rung, ...] = (
    Rung("grpo", "naive GRPO", {}, "the baseline"),
    Rung(
        "overlong_filter",
        "+ overlong filtering",
        {"reward.overlong.filter": "true"},
        "truncated responses stop teaching 'wrong' to reasoning that was cut off rather than "
        "mistaken",
    ),
    Rung(
        "clip_higher",
        "+ clip-higher",
        {"algorithm.clip_high": "0.28"},
        "low-probability tokens can gain more per update, which keeps entropy from collapsing",
    ),
    Rung(
        "soft_overlong",
        "+ soft overlong punishment",
        {"reward.overlong.enabled": "true"},
        "responses that run into the last buffer_len tokens lose reward in proportion, steering "
        "length",
    ),
    Rung(
        "token_loss",
        "+ token-level loss",
        {"algorithm.loss_agg": "token-mean"},
        "every token weighs the same, so long responses count fully and long bad patterns are "
        "punished",
    ),
    Rung(
        "dapo",
        "+ dynamic sampling (DAPO)",
        {"algorithm.gatekeeper": "true"},
        "all-correct and all-wrong groups (zero advantage) stop diluting the batch",
    ),
)


def rung_overrides(index: int) -> dict[str, str]:
    """The full overrides of rung `index`:
    naive GRPO plus every technique up to and including it."""
    out = dict(NAIVE_GRPO)
    for rung in LADDER[: index + 1]:
        out.update(rung.adds)
    return out


def seed_overrides(seed: int) -> dict[str, str]:
    """A seed changes the data order, the learner's and the replicas' randomness; never the base
    model or the evaluation set, which every rung shares."""
    return {"data.seed": str(seed), "learner.seed": str(seed), "rollout.seed": str(seed)}
