"""The fault suite's slowdown hook is absent outside the fault suite, and stretches work by its
factor inside it."""

from __future__ import annotations

import threading
import time

import pytest

from contracts import faults


def test_no_hook_unless_the_fault_suite_sets_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "FAULTS", {})
    assert faults.slowdown("rollout.slowdown") is None
    monkeypatch.setattr(faults, "FAULTS", {"rollout.slowdown": 3.0})
    hook = faults.slowdown("rollout.slowdown")
    assert hook is not None and hook.factor == 3.0
    assert faults.slowdown("learner.slowdown") is None
    with pytest.raises(ValueError, match="unknown fault"):
        faults.slowdown("reward.slowdown")


def test_parse_names_the_bad_item() -> None:
    assert faults._parse("learner.slowdown=10, rollout.slowdown=2") == {
        "learner.slowdown": 10.0,
        "rollout.slowdown": 2.0,
    }
    with pytest.raises(ValueError, match=r"unknown item 'gpu\.melt=2'"):
        faults._parse("gpu.melt=2")
    with pytest.raises(ValueError, match="must be >= 1"):
        faults._parse("learner.slowdown=0.5")


def test_a_slowed_step_sleeps_and_takes_a_wake_up_at_once() -> None:
    hook, wake, woken = faults.Slowdown(3.0), threading.Event(), []
    start = time.monotonic()
    hook.after(0.05)  # (3 - 1) x 0.05 s more
    assert time.monotonic() - start >= 0.1
    wake.set()
    hook.after(0.05, wake=wake, on_wake=lambda: (woken.append(1), wake.clear()))
    assert woken == [1]
