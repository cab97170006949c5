"""SIGTERM, as an orchestrator sends it before a pod goes away: every service finishes or hands
back its current item and exits 0 within its grace period; `dapo run` restarts it (the learner
resumes from the checkpoint it wrote on the way out); nothing is lost or dead-lettered."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
import redis

from services.run.redis_server import RedisServer
from tests.helpers import finish, learner_step, pid_of, pids, process_gone, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

STEPS = 120
GRACE_S = 30.0
"""The launcher's (and Kubernetes' default) grace period between SIGTERM and SIGKILL."""


def test_every_service_exits_cleanly_on_sigterm_and_the_run_goes_on(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        r = redis.Redis.from_url(server.url)
        # Long enough that the learner is still training when its turn comes (a step takes
        # tens of milliseconds here, and each restart before it takes seconds).
        proc = start_run(
            tmp_path, server.url, f"learner.total_steps={STEPS}", "checkpoint.every_steps=5"
        )
        exit_s = {}
        for role in ("rollout", "reward", "gatekeeper", "learner"):
            wait_for("progress", lambda: learner_step(r) >= 4 + 5 * len(exit_s))
            before = pids(r, role)
            pid = pid_of(r, role)
            os.kill(pid, signal.SIGTERM)
            start = time.monotonic()
            wait_for(f"the {role} to exit", lambda pid=pid: process_gone(pid), timeout_s=GRACE_S)
            exit_s[role] = round(time.monotonic() - start, 2)
            wait_for(
                f"a restarted {role}",
                lambda role=role, before=before: pids(r, role) - before,
                timeout_s=60,
            )
        logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
        summary = finish(proc, tmp_path)
    print(f"seconds from SIGTERM to exit: {exit_s}")
    launcher_log = (tmp_path / "dapo-run.log").read_text()
    # The supervisor saw four clean exits (code 0) and restarted each service once.
    assert len(re.findall(r"exited with 0; restart 1/", launcher_log)) == 4, launcher_log[-3000:]
    restarted = summary["restarts"]
    assert (
        restarted.get("learner") == 1
        and restarted.get("reward-0") == 1
        and restarted.get("gatekeeper") == 1
    )
    assert sum(v for k, v in restarted.items() if k.startswith("rollout")) == 1
    assert summary["steps"] == STEPS
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["dead"] == 0
    counters = summary["counters"]
    assert (
        counters.get("trained_twice", 0) == 0
        and counters.get("replica_version_regressions", 0) == 0
    )
    assert logs.count("received SIGTERM") == 4  # before the end of the run: the four sent above


def test_a_launcher_killed_outright_leaves_no_process_behind(tmp_path: Path) -> None:
    """`dapo run` SIGKILLed (an OOM kill, `kill -9`) cannot stop its services itself: each
    service and the embedded redis-server gets SIGTERM from the kernel when it dies (a
    parent-death signal), stops as on any SIGTERM and nothing of the run is left running."""
    proc = start_run(tmp_path, None, "learner.total_steps=100000")  # running when it is killed
    started: list[int] = []

    def every_service_started() -> bool:
        text = (tmp_path / "dapo-run.log").read_text()
        started[:] = [
            int(pid)
            for groups in re.findall(r"started \S+ \(pid (\d+)\)|redis-server pid (\d+)", text)
            for pid in groups
            if pid
        ]
        return "started rollout-1" in text and len(started) >= 7  # redis and six services

    try:
        wait_for("the run's processes", every_service_started, timeout_s=120)
        time.sleep(3)
        proc.kill()
        proc.wait()
        wait_for(
            "every process of the run to exit",
            lambda: all(process_gone(pid) for pid in started),
            timeout_s=GRACE_S + 30,
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in started:  # never leave one behind, whatever failed above
            if not process_gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
