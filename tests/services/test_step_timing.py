"""The run summary's steady-state pace (`services.run.progress.step_timing`)."""

from __future__ import annotations

import pytest

from services.run.progress import step_timing


def test_steps_per_hour_leave_the_warm_up_out() -> None:
    records = [
        {
            "step": s,
            "time": 100.0 + (10.0 if s <= 5 else 0.0) + 2.0 * s,
            "timing_s/step": 1.5,
            "timing_s/update_actor": 1.0,
            "timing_s/sync_weights": 0.01,
            "perf/learner_idle_fraction": 0.1,
        }
        for s in range(1, 26)
    ]
    timing = step_timing(records)
    assert timing["steps_per_hour"] == pytest.approx(1800.0)  # 2 s per step once warm
    assert (
        timing["step_s"] == 1.5
        and timing["update_actor_s"] == 1.0
        and timing["sync_weights_s"] == pytest.approx(0.01)
    )


def test_too_few_steps_give_no_pace() -> None:
    assert step_timing([{"step": 1, "time": 0.0}]) == {}
