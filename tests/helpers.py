"""Helpers shared by the tests that drive real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from contracts.bus import StreamBus
from contracts.config import DapoConfig, build_config
from contracts.keys import Keys
from contracts.schemas import RolloutGroup, ScoredGroup
from contracts.signing import KEY_ENV, weights_key
from gatekeeper.service import Gatekeeper

REPO = Path(__file__).resolve().parents[1]
TEST_WEIGHTS_KEY = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"
TEST_WEIGHTS_PUBLIC_KEY = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
"""The weight-sync key pair of the tests (RFC 8032's first Ed25519 test vector): the session's
environment holds it (tests/conftest.py), so `dapo run` and the services the tests start share
it."""
WEIGHTS_KEY = weights_key({KEY_ENV: os.environ.get(KEY_ENV) or TEST_WEIGHTS_KEY})
"""The private key, for publishers (and, verifying with its public half, receivers) built in a
test."""


def start_run(
    tmp_path: Path, url: str | None, *overrides: str, faults: str = ""
) -> subprocess.Popen[str]:
    """`dapo run` on the tiny preset with two rollout replicas against the test's Redis (None:
    its own embedded one), output in tmp_path/dapo-run.log (a pipe nobody reads could fill and
    block the launcher). No evals, no checkpoints unless the overrides ask for them. `faults` is
    passed as DAPO_FAULTS (contracts/faults.py)."""
    log = (tmp_path / "dapo-run.log").open("a")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            "--config",
            "configs/tiny.yaml",
            "--output-dir",
            str(tmp_path / "run"),
            "--quiet",
            *([f"queue.redis_url={url}"] if url is not None else []),
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            "rollout.replicas=2",  # the fault tests kill, hang and restart one of two
            *overrides,
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "DAPO_FAULTS": faults},
    )


def versions_by_pid(r: redis.Redis, role: str = "rollout") -> dict[int, int]:
    """pid -> policy version of every live instance of `role` (from the heartbeats)."""
    return {
        int(i["pid"]): int(i.get("policy_version", -1))
        for i in StreamBus(r, Keys("dapo"), "test").live_instances(role)
    }


def pids(r: redis.Redis, role: str) -> set[int]:
    """Process ids of the live instances of `role`."""
    return set(versions_by_pid(r, role))


def pid_of(r: redis.Redis, role: str) -> int:
    """The process id of one live instance of `role` (the lowest, so repeated calls agree)."""
    return min(pids(r, role))


def counter(r: redis.Redis, name: str) -> int:
    """A service counter of the run (as /status shows it)."""
    return int(r.hget(Keys("dapo").counters, name) or 0)


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def finish(proc: subprocess.Popen[str], tmp_path: Path, timeout_s: float = 900) -> dict[str, Any]:
    """Wait for a `start_run` run to end; assert it succeeded; return its summary.json."""
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (tmp_path / "dapo-run.log").read_text()[-3000:]
    return dict(json.loads((tmp_path / "run" / "summary.json").read_text()))


def wait_for(what: str, check: Any, timeout_s: float = 300, every_s: float = 0.2) -> Any:
    """Poll `check()` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f}s")


def learner_step(r: redis.Redis, namespace: str = "dapo") -> int:
    """The step the learner is on (as it publishes it in its state hash)."""
    return int(r.hget(f"{namespace}:learner:state", "step") or 0)


def model_config(
    tmp_path: Path, model_path: str, *, redis_url: str | None = None, **model: Any
) -> DapoConfig:
    """The smallest valid config around `model.path` (and other `model` fields): what the model
    resolution tests vary."""
    return build_config(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"path": model_path, **model},
            "data": {"train_path": str(tmp_path / "train.jsonl")},
            "rollout": {"max_response_len": 16},
            "reward": {"overlong": {"buffer_len": 4}},
            "queue": {"redis_url": redis_url},
        }
    )


def judged(group: RolloutGroup, acc: list[bool] | None = None) -> ScoredGroup:
    """`group` scored by hand: `acc` per response (default all correct), score and reward +1 for
    a correct response and -1 otherwise, no overlong penalty."""
    acc = [True] * len(group.responses) if acc is None else acc
    rewards = [1.0 if a else -1.0 for a in acc]
    return ScoredGroup.of(
        group, scores=list(rewards), acc=acc, rewards=rewards, preds=[""] * len(acc)
    )


def gatekeeper_on(bus: StreamBus, **options: Any) -> Gatekeeper:
    """A gatekeeper handed the whole bus for each concern it takes, as `gatekeeper.main` does."""
    return Gatekeeper(transport=bus, run_state=bus, telemetry=bus, prompt_history=bus, **options)
