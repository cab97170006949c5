"""One learner at a time, with real processes: while `dapo run` trains, a second learner started
against the same Redis (a redeploy overlapping the old pod) waits for the lease, then exits with
a message naming the holder; the run finishes with its ledger balanced and nothing trained
twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.helpers import REPO, finish, learner_step, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def test_a_second_learner_waits_then_exits_naming_the_holder(tmp_path: Path, redis_url: str) -> None:
    proc = start_run(tmp_path, redis_url, "learner.total_steps=20")
    wait_for("step 3", lambda: learner_step(redis.Redis.from_url(redis_url)) >= 3, timeout_s=600)
    second = subprocess.run(
        [sys.executable, "-m", "services.shell.cli", "learner", "--config", str(tmp_path / "run" / "config.yaml"),
         "learner.lease_wait_s=2"],
        cwd=REPO, env={**os.environ, "DAPO_REDIS_URL": redis_url}, capture_output=True, text=True, timeout=300,
    )
    assert second.returncode == 3, second.stderr[-3000:]
    assert "another learner holds the learner lease" in second.stderr and ":learner-" in second.stderr
    summary = finish(proc, tmp_path)
    assert summary["steps"] == 20 and summary["ledger"]["balanced"], summary["ledger"]
    assert summary["counters"].get("trained_twice", 0) == 0
