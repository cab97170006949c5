"""One learner at a time, with real processes: while `dapo run` trains, a second learner started
against the same Redis (a redeploy overlapping the old pod) waits for the lease, then exits with
a message naming the holder; the run finishes with its ledger balanced and nothing trained
twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from contracts.keys import Keys
from contracts.runtime import EXIT_NOT_THE_LEARNER, free_port
from tests.helpers import REPO, finish, learner_step, start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def test_a_second_learner_waits_then_exits_naming_the_holder(
    tmp_path: Path, redis_url: str
) -> None:
    proc = start_run(tmp_path, redis_url, "learner.total_steps=20")
    wait_for("step 3", lambda: learner_step(redis.Redis.from_url(redis_url)) >= 3, timeout_s=600)
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "learner",
            "--config",
            str(tmp_path / "run" / "config.yaml"),
            "learner.lease_wait_s=2",
        ],
        cwd=REPO,
        env={**os.environ, "DAPO_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == EXIT_NOT_THE_LEARNER, second.stderr[-3000:]
    assert (
        "another learner holds the learner lease" in second.stderr and ":learner-" in second.stderr
    )
    summary = finish(proc, tmp_path)
    assert summary["steps"] == 20 and summary["ledger"]["balanced"], summary["ledger"]
    assert summary["counters"].get("trained_twice", 0) == 0


RANK_SCRIPT = """
import sys
from pathlib import Path
from contracts.config import load_config
from learner.service import main
cfg = load_config(sys.argv[1], sys.argv[3:])
code = main(cfg)
Path(sys.argv[2]).write_text(str(code))
sys.exit(code)
"""


def test_every_rank_learns_that_rank_0_is_not_the_runs_learner(
    tmp_path: Path, redis_url: str
) -> None:
    """Only rank 0 talks to Redis; the others must still exit EXIT_NOT_THE_LEARNER, not fail on a
    collective rank 0 left. Two ranks as plain processes (no torchrun to end one early), each
    recording what `learner.service.main` returned."""
    redis.Redis.from_url(redis_url).set(Keys("dapo").learner_lease, "7:learner-elsewhere", ex=300)
    port = free_port()
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK_SCRIPT,
                str(REPO / "configs" / "tiny.yaml"),
                str(tmp_path / f"rank{rank}.code"),
                # Rank 0 waits for the lease longer than a collective may take:
                # the verdict must still arrive.
                f"output_dir={tmp_path}",
                "learner.lease_wait_s=6",
                "learner.backend=gloo",
                "learner.collective_timeout_s=2",
            ],
            cwd=REPO,
            env={
                **os.environ,
                "DAPO_REDIS_URL": redis_url,
                "OMP_NUM_THREADS": "1",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    errors = [proc.communicate(timeout=180)[1] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [EXIT_NOT_THE_LEARNER] * 2, errors[1][-3000:]
    assert [(tmp_path / f"rank{rank}.code").read_text() for rank in (0, 1)] == [
        str(EXIT_NOT_THE_LEARNER)
    ] * 2


def test_every_rank_of_a_learner_that_is_not_the_runs_learner_exits_3(
    tmp_path: Path, redis_url: str
) -> None:
    """The real two-rank learner through the learner Job's container command (learner_torchrun),
    started while another learner holds the lease: the container exits 3, which fails the Job at
    once, and its log names the holder. Which rank torchrun sees end first is a race that this
    test rarely loses; the test above pins that every rank returns 3."""
    redis.Redis.from_url(redis_url).set(Keys("dapo").learner_lease, "7:learner-elsewhere", ex=300)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.run.learner_torchrun",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            "services.cli",
            "learner",
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            f"output_dir={tmp_path}",
            "learner.lease_wait_s=1",
            "learner.backend=gloo",
        ],
        cwd=REPO,
        env={**os.environ, "DAPO_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NOT_THE_LEARNER, out[-3000:]
    # torchrun's table of failed ranks: each exited 3, or was still exiting 3 when torchrun ended
    # it on the first failure (SIGTERM); none failed on its own.
    exit_codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert "3" in exit_codes and set(exit_codes) <= {"3", "-15"}, out[-3000:]
    assert "learner-elsewhere" in out


def test_a_learner_that_fails_before_training_gives_the_lease_back(
    tmp_path: Path, redis_url: str
) -> None:
    """The lease is taken before the model loads: a learner whose model does not load must not
    hold the run for the lease's TTL (its restart would wait that long, or exit as not the
    learner)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # no model_type: transformers refuses it
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "learner",
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            f"output_dir={tmp_path}",
            f"model.path={model}",
            "learner.lease_ttl_s=300",
        ],
        cwd=REPO,
        env={**os.environ, "DAPO_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode not in (0, 3), proc.stderr[-3000:]
    assert "holding the learner lease" in proc.stderr
    assert redis.Redis.from_url(redis_url).get(Keys("dapo").learner_lease) is None
