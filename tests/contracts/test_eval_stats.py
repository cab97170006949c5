"""Statistics of evaluation rounds: the interval has the width binomial theory gives, a paired
comparison recovers a known time ratio, and the area measure counts every round."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from contracts.eval_stats import (
    Round,
    accuracy_interval,
    area_per_rl_second,
    compare,
    read_rounds,
    seconds_to_gain,
)


def test_the_interval_over_problems_has_the_binomial_width() -> None:
    rng = random.Random(0)
    n, p = 800, 0.4
    per_problem = [float(rng.random() < p) for _ in range(n)]
    low, high = accuracy_interval(per_problem)
    mean = sum(per_problem) / n
    half = 1.96 * math.sqrt(mean * (1 - mean) / n)  # 3.4 points for 800 problems
    assert low < mean < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.1)
    assert accuracy_interval([0.5] * 50) == (0.5, 0.5)  # no spread, no width


def test_time_to_gain_reads_the_common_base() -> None:
    curve = [(0.0, 0.30), (10.0, 0.50), (20.0, 0.60)]
    assert seconds_to_gain(curve, base=0.25, gain=0.25) == 10.0
    assert seconds_to_gain(curve, base=0.30, gain=0.25) == 20.0  # another base, another crossing
    assert math.isnan(seconds_to_gain(curve, base=0.40, gain=0.25))


def test_the_area_holds_each_round_until_the_next() -> None:
    curve = [(0.0, 0.2), (10.0, 0.4), (30.0, 0.6)]
    assert area_per_rl_second(curve, until=30.0) == pytest.approx((0.2 * 10 + 0.4 * 20) / 30)
    assert area_per_rl_second(curve, until=40.0) == pytest.approx((2 + 8 + 0.6 * 10) / 40)


def _rounds(times: list[float], accs: list[list[float]]) -> list[Round]:
    return [
        Round(step=i, rl_seconds=t, per_problem=tuple(a))
        for i, (t, a) in enumerate(zip(times, accs, strict=True))
    ]


def test_a_paired_comparison_recovers_a_known_ratio() -> None:
    """Arm A runs the very curve of arm B in half the RL seconds: ratio 0.5, and since every
    resample moves both arms alike, the interval is 0.5 too (pairing removes problem noise)."""
    rng = random.Random(1)
    problems = 400
    skill = [rng.random() for _ in range(problems)]
    accs = [[min(1.0, s * f) for s in skill] for f in (0.5, 0.8, 1.1, 1.4)]
    base = accs[0]
    slow = _rounds([0.0, 20.0, 40.0, 60.0], accs)
    fast = _rounds([0.0, 10.0, 20.0, 30.0], accs)
    result = compare(fast, slow, base, gain=0.25)
    assert result.time_ratio == pytest.approx(0.5)
    assert result.time_ratio_ci == pytest.approx((0.5, 0.5))
    assert result.area_ratio > 1  # the fast arm's gain lasts longer within the common horizon
    assert result.area_ratio_ci[0] > 1


def test_an_arm_that_never_gets_there_has_no_upper_bound() -> None:
    base = [0.2] * 100
    flat = _rounds([0.0, 10.0], [[0.2] * 100, [0.25] * 100])
    rising = _rounds([0.0, 10.0], [[0.2] * 100, [0.6] * 100])
    result = compare(flat, rising, base, gain=0.25)
    assert math.isnan(result.seconds_a) and result.seconds_b == 10.0
    assert result.time_ratio_ci[1] == math.inf
    with pytest.raises(ValueError, match="cover the base figure"):
        compare(flat, rising, [0.2] * 99, gain=0.25)


def test_rounds_round_trip_through_the_run_file(tmp_path: Path) -> None:
    rounds = _rounds([5.0, 0.0], [[1.0, 0.0], [0.5, 0.5]])
    (tmp_path / "eval_rounds.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in rounds)
    )
    back = read_rounds(tmp_path)
    assert [r.rl_seconds for r in back] == [0.0, 5.0]  # in time order
    assert back[1].per_problem == (1.0, 0.0) and back[1].acc == 0.5
