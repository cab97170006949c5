"""End to end: `dapo run` on the tiny preset trains on a user's `reward.function`.

The function is `tests/reward/sample_rewards.py:answer_digit`, given by file path as a user
would: 0.5 for a response containing the ground truth's last digit, -0.25 otherwise, never the
built-in verifiers' +1 / -1. With overlong shaping off, every step's logged mean reward must be
exactly -0.25 + 0.75 x its mean accuracy, which only that function produces; its metrics,
reported by the reward worker, show that the data rows' `extra_info` reached it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis

from contracts.bus import StreamBus
from contracts.keys import Keys
from tests.helpers import finish, start_run
from tests.reward.sample_rewards import RIGHT_SCORE, WRONG_SCORE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

STEPS = 10


def test_a_run_trains_on_the_rewards_of_a_custom_function(tmp_path: Path, redis_url: str) -> None:
    proc = start_run(
        tmp_path,
        redis_url,
        f"learner.total_steps={STEPS}",
        "reward.function=tests/reward/sample_rewards.py:answer_digit",
        "reward.overlong.enabled=false",
    )
    summary = finish(proc, tmp_path)
    assert summary["steps"] == STEPS
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["trained"] == STEPS * 16
    assert summary["restarts"] == {}

    curve = summary["reward_curve"]
    assert [row[0] for row in curve] == list(range(1, STEPS + 1))
    for step, reward, acc in curve:
        # The gatekeeper keeps only groups with both right and wrong responses.
        assert 0.0 < acc < 1.0, (step, acc)
        expected = WRONG_SCORE + (RIGHT_SCORE - WRONG_SCORE) * acc
        assert math.isclose(reward, expected, abs_tol=1e-9), (step, reward, acc)
    # The built-in scores would give 2 x acc - 1 (the two lines cross only at acc 0.6).
    assert any(not math.isclose(reward, 2 * acc - 1, abs_tol=1e-6) for _, reward, acc in curve)

    bus = StreamBus(redis.Redis.from_url(redis_url), Keys("dapo"), "test")
    (reward_stats,) = bus.final_stats("reward").values()
    assert reward_stats["unverified"] == 0 and reward_stats["timeouts"] == 0
    metrics = reward_stats["metrics"]
    assert metrics["has_expression"] == 1.0  # every row's extra_info arrived (training and eval)
    assert metrics["response_chars"] > 0
