"""Statistics of evaluation rounds: intervals, time to a target, area under the curve.

Every figure this project reports about learning is read off evaluation rounds (avg@k over the
evaluation set's distinct problems). A round is kept as its per-problem accuracies (`Round`), so
its figures can carry a bootstrap interval over problems, and two runs evaluated on the same
problems with the same sample seeds (paired evaluation, `eval.seed`) can be compared by
resampling the same problems in both: what differs between the arms is then their weights, not
which problems or which random draws each happened to get.

Pure Python and numpy; no torch. The only I/O is `read_rounds`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EVAL_ROUNDS_FILE = "eval_rounds.jsonl"
"""In a run's output directory: one `Round` per line, as the learner (or the in-process loop)
reported it."""
RESAMPLES = 2000
"""Bootstrap resamples: enough for the 2.5th and 97.5th percentiles to move by < 0.1 point."""
LEVEL = 0.95


@dataclass(frozen=True)
class Round:
    """One evaluation round: the accuracy of each distinct problem (correct / samples), the
    policy it measured and when, in seconds of RL, that policy was published."""

    step: int
    """The learner step whose weights produced the samples (the round is credited to it)."""
    rl_seconds: float
    """RL seconds at which those weights were published."""
    per_problem: tuple[float, ...]
    policy_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def acc(self) -> float:
        return sum(self.per_problem) / len(self.per_problem) if self.per_problem else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rl_seconds": self.rl_seconds,
            "policy_version": self.policy_version,
            "acc": self.acc,
            "per_problem": list(self.per_problem),
            **self.extra,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Round:
        known = {"step", "rl_seconds", "policy_version", "acc", "per_problem"}
        return cls(
            step=int(row["step"]),
            rl_seconds=float(row["rl_seconds"]),
            per_problem=tuple(float(x) for x in row["per_problem"]),
            policy_version=int(row.get("policy_version", 0)),
            extra={k: v for k, v in row.items() if k not in known},
        )


def read_rounds(path: str | Path) -> list[Round]:
    """The rounds of a run, from its output directory or its `EVAL_ROUNDS_FILE`, by step."""
    path = Path(path)
    if path.is_dir():
        path = path / EVAL_ROUNDS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((Round.from_json(r) for r in rows), key=lambda r: (r.rl_seconds, r.step))


def _indices(problems: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, problems) problem indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, problems, size=(resamples, problems))


def _interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size < values.size * level:  # most resamples never got there: no bound above
        low = float(np.quantile(finite, (1 - level) / 2)) if finite.size else math.nan
        return low, math.inf
    tail = (1 - level) / 2
    return float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))


def accuracy_interval(
    per_problem: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean accuracy, resampling problems (the unit
    that varies most: a round's samples of one problem are not independent draws of it)."""
    acc = np.asarray(per_problem, dtype=float)
    if acc.size == 0:
        return math.nan, math.nan
    means = acc[_indices(acc.size, resamples, seed)].mean(axis=1)
    return _interval(means)


def seconds_to_gain(curve: Sequence[tuple[float, float]], base: float, gain: float) -> float:
    """RL seconds of the first (rl_seconds, accuracy) point at least `gain` above `base` (nan if
    none). `base` is one figure for every arm of a comparison (`base_figure`), not each run's own
    noisy first round."""
    return next((t for t, acc in curve if acc >= base + gain - 1e-9), math.nan)


def area_per_rl_second(curve: Sequence[tuple[float, float]], until: float) -> float:
    """Mean accuracy over RL time up to `until`: the area under the step-wise accuracy curve
    (each round's accuracy holds until the next round) divided by `until`. A second measure
    beside time to target: it counts every round, not one crossing. Compare arms at the same
    `until` (the shorter run's last round)."""
    points = sorted((t, a) for t, a in curve if t <= until)
    if not points or until <= 0:
        return math.nan
    area = 0.0
    for (t0, a0), (t1, _) in zip(points, [*points[1:], (until, math.nan)], strict=True):
        area += a0 * (t1 - t0)
    return area / (until - points[0][0]) if until > points[0][0] else points[0][1]


def _curves(rounds: Sequence[Round], idx: np.ndarray) -> np.ndarray:
    """(resamples, rounds) accuracy of each round on each resample of the problems."""
    per = np.asarray([r.per_problem for r in rounds], dtype=float)  # (rounds, problems)
    curves: np.ndarray = per[:, idx].mean(axis=2).T
    return curves


def _crossings(times: np.ndarray, accs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """First time each resample's curve reaches its target (inf if never)."""
    reached = accs >= targets[:, None] - 1e-9  # (resamples, rounds)
    first = np.where(reached.any(axis=1), reached.argmax(axis=1), -1)
    out = np.full(len(first), math.inf)
    out[first >= 0] = times[first[first >= 0]]
    return out


@dataclass(frozen=True)
class Comparison:
    """Arm A against arm B on the same problems (paired): time to `gain` points above one common
    base, and the mean gain over that base per RL second (the area under the curve, up to the
    shorter run's end), as A's over B's, each with a bootstrap 95% interval."""

    time_ratio: float
    time_ratio_ci: tuple[float, float]
    area_ratio: float
    area_ratio_ci: tuple[float, float]
    seconds_a: float
    seconds_b: float

    def to_json(self) -> dict[str, Any]:
        return {
            "time_ratio": self.time_ratio,
            "time_ratio_ci": list(self.time_ratio_ci),
            "area_ratio": self.area_ratio,
            "area_ratio_ci": list(self.area_ratio_ci),
            "seconds_a": self.seconds_a,
            "seconds_b": self.seconds_b,
        }


def compare(
    a: Sequence[Round],
    b: Sequence[Round],
    base: Sequence[float],
    gain: float,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Comparison:
    """Paired bootstrap over problems: each resample draws one set of problem indices and
    applies it to both arms' rounds and to the common base (`base`: per-problem accuracy of the
    starting model, measured once with many samples). Every arm must have evaluated the same
    problems in the same order."""
    problems = len(base)
    for rounds in (a, b):
        if any(len(r.per_problem) != problems for r in rounds):
            raise ValueError("every round must cover the base figure's problems, in its order")
    until = min(a[-1].rl_seconds, b[-1].rl_seconds)
    idx = _indices(problems, resamples, seed)
    bases = np.asarray(base, dtype=float)[idx].mean(axis=1)  # (resamples,)
    stats = {}
    for name, rounds in (("a", a), ("b", b)):
        times = np.asarray([r.rl_seconds for r in rounds])
        accs = _curves(rounds, idx)
        areas = [area_per_rl_second(list(zip(times, row, strict=True)), until) for row in accs]
        # The area of the gain over the common base: the base is in both arms and would only
        # pull the ratio toward 1.
        stats[name] = (_crossings(times, accs, bases + gain), np.asarray(areas) - bases)
    base_acc = float(np.mean(base))
    seconds_a = seconds_to_gain([(r.rl_seconds, r.acc) for r in a], base_acc, gain)
    seconds_b = seconds_to_gain([(r.rl_seconds, r.acc) for r in b], base_acc, gain)
    with np.errstate(invalid="ignore", divide="ignore"):
        time_ratios = stats["a"][0] / stats["b"][0]
        area_ratios = stats["a"][1] / stats["b"][1]
    area_a = area_per_rl_second([(r.rl_seconds, r.acc) for r in a], until) - base_acc
    area_b = area_per_rl_second([(r.rl_seconds, r.acc) for r in b], until) - base_acc
    return Comparison(
        time_ratio=seconds_a / seconds_b if seconds_b else math.nan,
        time_ratio_ci=_interval(np.where(np.isnan(time_ratios), math.inf, time_ratios)),
        area_ratio=area_a / area_b if area_b else math.nan,
        area_ratio_ci=_interval(area_ratios),
        seconds_a=seconds_a,
        seconds_b=seconds_b,
    )
