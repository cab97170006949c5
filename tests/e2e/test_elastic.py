"""Elastic rollout membership with real processes: start with 1 replica, add a 2nd and a 3rd
mid-run, kill one with SIGKILL, finish the run. The ledger balances, nothing is trained twice,
and every surviving replica ends on the final policy version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from services.run.redis_server import RedisServer
from tests.helpers import learner_step, versions_by_pid, wait_for

REPO = Path(__file__).resolve().parents[2]


def LOG(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Where the launcher's output goes (a pipe nobody reads could fill and block it)."""
    return (tmp_path / "dapo-run.log").open("a")


# Long enough that the joins and the kill all land mid-run even when generation with 3 replicas
# outpaces the waits below (45 steps was once over before the kill, and 80 on a loaded machine
# once the steps got faster; the kill lands near step 30 on a quiet machine).
TOTAL_STEPS = 160

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def test_replicas_join_and_leave_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "run",
                "--config",
                "configs/tiny.yaml",
                "--output-dir",
                str(out),
                "--quiet",
                f"queue.redis_url={server.url}",
                "rollout.replicas=1",
                f"learner.total_steps={TOTAL_STEPS}",
                "eval.every_steps=0",
                "checkpoint.every_steps=10",
                "queue.heartbeat_ttl_s=6",
            ],
            cwd=REPO,
            stdout=LOG(tmp_path),
            stderr=subprocess.STDOUT,
            text=True,
        )
        extra: list[subprocess.Popen[bytes]] = []
        try:
            env = {**os.environ, "DAPO_REDIS_URL": server.url}
            config = str(out / "config.yaml")
            wait_for("step 5", lambda: learner_step(r) >= 5)
            for target in (10, 18):
                extra.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "services.cli", "rollout", "--config", config],
                        cwd=REPO,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                want = len(extra) + 1
                wait_for(f"{want} replicas", lambda want=want: len(versions_by_pid(r)) == want, 120)
                wait_for(f"step {target}", lambda t=target: learner_step(r) >= t)
            # The newcomers caught up and receive every broadcast.
            versions = wait_for(
                "3 replicas in sync",
                lambda: (
                    (v := versions_by_pid(r)) and len(set(v.values())) == 1 and len(v) == 3 and v
                ),
                60,
            )
            assert min(versions.values()) >= 17  # step N is trained by version N - 1
            victim = extra[0]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            killed_at = learner_step(r)
            run.wait(timeout=900)
            output = (tmp_path / "dapo-run.log").read_text()
            assert run.returncode == 0, output[-3000:]
            survivors = {p.pid for p in extra[1:]}
            final = {pid: v for pid, v in versions_by_pid(r).items() if pid in survivors}
        finally:
            for p in [*extra, run]:
                if p.poll() is None:
                    p.terminate()
                    p.wait(30)
        summary = json.loads((out / "summary.json").read_text())
        # The kill landed mid-run, with steps left to train after it.
        assert summary["steps"] == TOTAL_STEPS and killed_at < TOTAL_STEPS - 5, killed_at
        ledger = summary["ledger"]
        assert ledger["balanced"], ledger
        counters = summary["counters"]
        assert counters.get("trained_twice", 0) == 0
        assert counters.get("replica_version_regressions", 0) == 0
        # The replica started by dapo run and the surviving newcomer both hold the final version.
        assert set(summary["replica_final_versions"].values()) == {summary["policy_version"]}
        assert final and set(final.values()) == {summary["policy_version"]}
