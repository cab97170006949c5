"""Kill the learner mid-run: the supervisor restarts it, it resumes from the newest committed
checkpoint, and nothing is lost or trained twice. Then `dapo run --resume` continues a finished
run from its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from contracts.checkpoint_store import latest_checkpoint
from services.run.redis_server import RedisServer
from tests.helpers import learner_step, pid_of, pids, wait_for

REPO = Path(__file__).resolve().parents[2]


def LOG(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Where the launcher's output goes (a pipe nobody reads could fill and block it)."""
    return (tmp_path / "dapo-run.log").open("a")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def dapo_run(out: Path, url: str, *overrides: str, resume: bool = False) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        "configs/tiny.yaml",
        "--output-dir",
        str(out),
        "--quiet",
        f"queue.redis_url={url}",
        "eval.every_steps=0",
        "checkpoint.every_steps=5",
        *overrides,
    ]
    if resume:
        cmd.append("--resume")
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=LOG(out.parent), stderr=subprocess.STDOUT, text=True
    )


def _training_again(r: redis.Redis, killed: int) -> bool:
    """A learner other than the killed one is up
    (the killed one's heartbeat may linger) and training."""
    return (
        bool(pids(r, "learner") - {killed}) and r.hget("dapo:learner:state", "state") == b"training"
    )


def test_learner_killed_mid_run_resumes_without_loss(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        proc = dapo_run(out, server.url, "learner.total_steps=30")
        try:
            wait_for("step 12", lambda: learner_step(r) >= 12)
            killed = pid_of(r, "learner")
            os.kill(killed, signal.SIGKILL)
            killed_at, step_at_kill = time.monotonic(), learner_step(r)
            wait_for(
                "the restarted learner training", lambda: _training_again(r, killed), every_s=0.1
            )
            recovery_s = time.monotonic() - killed_at
            proc.wait(timeout=900)
            output = (tmp_path / "dapo-run.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, output[-4000:]
        summary = json.loads((out / "summary.json").read_text())
        print(
            f"learner SIGKILL at step {step_at_kill}: training again {recovery_s:.1f}s later "
            "(supervisor back-off, process start, checkpoint load)"
        )
        assert summary["restarts"] == {"learner": 1}
        assert summary["steps"] == 30
        ledger = summary["ledger"]
        assert ledger["balanced"] and ledger["in_flight"] == 0
        counters = summary["counters"]
        assert counters.get("trained_twice", 0) == 0
        assert counters.get("replica_version_regressions", 0) == 0
        # The resumed learner numbers its versions above anything published before the kill.
        assert summary["policy_version"] >= 30
        assert set(summary["replica_final_versions"].values()) == {summary["policy_version"]}
        latest = latest_checkpoint(out / "checkpoints")
        assert latest is not None and latest.step == 30
        assert latest.meta["scheduler"]["last_epoch"] == 30  # the lr schedule resumed, not replayed

        # Continue the finished run for 5 more steps with --resume.
        proc = dapo_run(out, server.url, "learner.total_steps=35", resume=True)
        proc.wait(timeout=600)
        output = (tmp_path / "dapo-run.log").read_text()
        assert proc.returncode == 0, output[-4000:]
        summary2 = json.loads((out / "summary.json").read_text())
        assert summary2["steps"] == 35
        assert summary2["ledger"]["balanced"] and summary2["ledger"]["in_flight"] == 0
        assert summary2["ledger"]["trained"] == summary["ledger"]["trained"] + 5 * 16
        assert summary2["policy_version"] == summary["policy_version"] + 5
