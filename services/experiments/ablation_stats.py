"""What the ladder's runs yield and how a rung's seeds are pooled: one run's figures
(`RunResult`), accuracy averaged over the budget (`mean_over_budget`), the completed runs
read against one common base (`Ladder`), and per rung its final accuracy, its difference
from the first rung and its mean gain over the base, with 95% intervals from a two-level
bootstrap over the seeds, then the problems (`rung_stats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from services.experiments.ablation_ladder import LADDER, Rung

EARLY_GAIN = 0.10
"""A second, nearer target the table reports beside `gain`: at toy scale and a fixed budget not
every rung gets to +25 points, and how early each starts to learn still tells rungs apart."""


@dataclass
class RunResult:
    """What the table needs from one run."""

    rung: str
    seed: int
    base_acc: float
    """The run's first round (the base weights); the same in every run when evaluation is
    paired."""
    final_acc: float
    samples: int
    """Responses requested for training over the run (issued prompt jobs x group size)."""
    samples_to_target: float | None
    """Responses generated when an evaluation first reached the common base + gain; None: not
    reached."""
    samples_to_early_target: float | None
    """The same for base + EARLY_GAIN (10 points): how fast a rung starts learning."""
    filtered_share: float
    truncation_rate: float
    final_entropy: float
    wall_s: float
    steps: int
    acc_curve: list[tuple[float, float]] = field(default_factory=list)
    """(responses generated, eval accuracy) of every evaluation round."""
    entropy_curve: list[tuple[float, float]] = field(default_factory=list)
    """(responses generated, mean token entropy of the step's training batch)."""
    base_problems: list[float] = field(default_factory=list, repr=False)
    """Per-problem accuracy of the first round (the report's common base)."""
    final_problems: list[float] = field(default_factory=list, repr=False)
    """Per-problem accuracy of the last round."""
    mean_problems: list[float] = field(default_factory=list, repr=False)
    """Per-problem accuracy averaged over the budget (`mean_over_budget`)."""

    def to_json(self) -> dict[str, object]:
        """Every figure but the per-problem lists (the rung statistics summarise them)."""
        out = asdict(self)
        for key in ("base_problems", "final_problems", "mean_problems"):
            out.pop(key)
        return out


def mean_over_budget(
    xs: Sequence[float], per_problem: Sequence[Sequence[float]], end: float
) -> list[float]:
    """Each problem's accuracy averaged over generated responses from the first round to `end`
    (the budget): each round's accuracy holds until the next round (the area under the step-wise
    curve over its length). Linear in the rounds, so the pooled statistics resample it like an
    accuracy. A second measure beside the final round: it counts how early a rung learned."""
    rounds = np.asarray(per_problem, dtype=float)
    bounds = np.asarray([*xs[1:], end], dtype=float)
    widths = np.clip(bounds - np.asarray(xs, dtype=float), 0.0, None)
    if widths.sum() <= 0:
        return [float(v) for v in rounds[-1]]
    return [float(v) for v in widths @ rounds / widths.sum()]


@dataclass
class Ladder:
    """The completed runs of a ladder, read against one common base."""

    runs: list[RunResult]
    base: float
    """Accuracy of the base weights: the mean of the runs' first rounds."""
    paired: bool
    """Every run's first round was the same, problem by problem (paired evaluation)."""


@dataclass(frozen=True)
class RungStats:
    """A rung's seeds pooled problem by problem (each problem's accuracy averaged over the
    seeds' rounds), with 95% intervals from a two-level bootstrap: each resample draws the
    rung's seeds with replacement and then the problems (the same problems for every rung, so
    comparisons are paired). The interval so counts both what varies between training runs and
    what varies between evaluation problems."""

    rung: str
    runs: int
    final: float
    final_ci: tuple[float, float]
    seeds_final: list[float]
    vs_first: float | None
    """Final accuracy minus the first rung's (naive GRPO's), paired over problems."""
    vs_first_ci: tuple[float, float] | None
    mean_gain: float
    """Accuracy averaged over the budget minus the common base (`mean_over_budget`)."""
    mean_gain_ci: tuple[float, float]


def _resampled(per_seed: np.ndarray, problems: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(resamples,) mean accuracy of a rung under the two-level bootstrap: per resample, its
    seeds drawn with replacement, each seed's accuracy over that resample's problems."""
    by_seed = per_seed[:, problems].mean(axis=2)  # (seeds, resamples)
    seeds, resamples = by_seed.shape
    drawn = rng.integers(0, seeds, size=(resamples, seeds))
    out: np.ndarray = by_seed[drawn, np.arange(resamples)[:, None]].mean(axis=1)
    return out


def _interval95(values: np.ndarray) -> tuple[float, float]:
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))


def rung_stats(
    ladder: Ladder, rungs: Sequence[Rung] = LADDER, *, resamples: int = 2000, seed: int = 0
) -> list[RungStats]:
    """One `RungStats` per rung that has runs; the first rung with runs is the reference."""
    if not ladder.runs:
        return []
    base = np.mean([r.base_problems for r in ladder.runs], axis=0)
    rng = np.random.default_rng(seed)
    problems = rng.integers(0, base.size, size=(resamples, base.size))
    per_rung = {}
    for rung in rungs:
        rows = [r for r in ladder.runs if r.rung == rung.key]
        if rows:
            finals = np.asarray([r.final_problems for r in rows])
            gains = np.asarray([r.mean_problems for r in rows]) - base
            per_rung[rung.key] = (
                rows,
                finals,
                gains,
                _resampled(finals, problems, rng),
                _resampled(gains, problems, rng),
            )
    first = next(iter(per_rung))
    out = []
    for key, (rows, finals, gains, final_draws, gain_draws) in per_rung.items():
        reference = per_rung[first]
        vs = None if key == first else float(finals.mean() - reference[1].mean())
        out.append(
            RungStats(
                rung=key,
                runs=len(rows),
                final=float(finals.mean()),
                final_ci=_interval95(final_draws),
                seeds_final=[r.final_acc for r in rows],
                vs_first=vs,
                vs_first_ci=None if vs is None else _interval95(final_draws - reference[3]),
                mean_gain=float(gains.mean()),
                mean_gain_ci=_interval95(gain_draws),
            )
        )
    return out
