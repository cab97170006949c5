"""The learner container's exit code, for real: the command of the learner Job
(deploy/k8s/base/learner.yaml: torchrun through services.run.learner_torchrun) with its
`-m services.cli learner` tail swapped for a fake learner whose ranks exit with chosen codes.

The Job's podFailurePolicy (checked in test_manifests.py) fails the Job on 3 and 4 and retries
anything else; these tests check that the container exits with those codes, which torchrun alone
does not (it exits 1 for any failed rank).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from contracts.runtime import (
    CHECKPOINT_REFUSED_FILE,
    EXIT_BAD_CONFIG,
    EXIT_CHECKPOINT_REFUSED,
    EXIT_NOT_THE_LEARNER,
    free_port,
)
from services.run.learner_torchrun import container_exit_code

REPO = Path(__file__).resolve().parents[2]
LEARNER_JOB = REPO / "deploy" / "k8s" / "base" / "learner.yaml"

# argv: OUT_DIR CODES. CODES holds one entry per rank: an exit code; `wait` (run until torchrun
# ends it); or `stop` (run until SIGTERM, then exit 0 as the learner does after checkpointing).
FAKE_LEARNER = f"""
import os, signal, sys, time
from pathlib import Path

rank = int(os.environ["RANK"])
out = Path(sys.argv[1])
what = sys.argv[2].split(",")[rank]

def stop(signum, frame):
    (out / f"stopped-{{rank}}").touch()
    sys.exit(0)

if what in ("wait", "stop"):
    if what == "stop":
        signal.signal(signal.SIGTERM, stop)
        (out / f"ready-{{rank}}").touch()
    while True:
        time.sleep(0.1)
if int(what) == {EXIT_CHECKPOINT_REFUSED}:  # as learner/service.py does
    (out / "{CHECKPOINT_REFUSED_FILE}").write_text("step 5 failed verification\\n")
sys.exit(int(what))
"""


def container_command(tmp_path: Path, nproc: int, codes: str) -> list[str]:
    """The learner container's command from the manifest, its $(VARS) filled in for one local node,
    running the fake learner instead of `-m services.cli learner --config ...`."""
    job = next(
        d for d in yaml.safe_load_all(LEARNER_JOB.read_text(encoding="utf-8")) if d["kind"] == "Job"
    )
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    env |= {
        "NPROC_PER_NODE": str(nproc),
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    argv = [
        re.sub(r"\$\((\w+)\)", lambda m: str(env[m.group(1)]), arg) for arg in container["command"]
    ]
    assert argv[0] == "python", argv
    learner_module = argv.index("services.cli") - 1  # torchrun's `-m` before the learner
    script = tmp_path / "fake_learner.py"
    script.write_text(FAKE_LEARNER, encoding="utf-8")
    return [sys.executable, *argv[1:learner_module], str(script), str(tmp_path), codes]


def run_container(tmp_path: Path, nproc: int, codes: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        container_command(tmp_path, nproc, codes),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("nproc", "codes", "expected"),
    [
        (1, "4", EXIT_CHECKPOINT_REFUSED),
        (1, "3", EXIT_NOT_THE_LEARNER),
        (1, "2", EXIT_BAD_CONFIG),
        (1, "1", 1),
        (1, "0", 0),
        (2, "wait,4", EXIT_CHECKPOINT_REFUSED),  # one rank refuses; torchrun ends the other
        (2, "3,wait", EXIT_NOT_THE_LEARNER),
    ],
)
def test_container_exits_with_the_learners_code(
    tmp_path: Path, nproc: int, codes: str, expected: int
) -> None:
    proc = run_container(tmp_path, nproc, codes)
    assert proc.returncode == expected, proc.stderr[-3000:]
    if expected in (EXIT_CHECKPOINT_REFUSED, EXIT_NOT_THE_LEARNER):
        # The pod's termination message is the log's tail (FallbackToLogsOnError): it says why.
        last = proc.stderr.strip().splitlines()[-1]
        assert f"exiting {expected}: " in last, last
        assert (
            "refused the newest checkpoint" if expected == EXIT_CHECKPOINT_REFUSED else "lease"
        ) in last, last


def test_torchrun_alone_reports_every_failure_as_1(tmp_path: Path) -> None:
    """Why the wrapper exists (torch 2.13):
    the same command through plain torchrun loses the code."""
    argv = container_command(tmp_path, 1, str(EXIT_CHECKPOINT_REFUSED))
    plain = [sys.executable, "-m", "torch.distributed.run", *argv[3:]]
    proc = subprocess.run(plain, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]


def test_a_refusal_file_left_behind_does_not_fail_a_healthy_start(tmp_path: Path) -> None:
    """The operator moved the bad step aside; the learner's file from the refusal is still there
    (nothing on Kubernetes deletes it). The next start exits 0: only exit codes decide."""
    assert run_container(tmp_path, 1, "4").returncode == EXIT_CHECKPOINT_REFUSED
    assert (tmp_path / CHECKPOINT_REFUSED_FILE).exists()
    proc = run_container(tmp_path, 1, "0")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_sigterm_stops_the_ranks_and_exits_143_so_the_job_is_not_complete(tmp_path: Path) -> None:
    """A drained pod: the ranks get SIGTERM and exit 0 after checkpointing, but the run is not
    done. Exit 0 would make the Job count its only completion; 143 gets the pod replaced (and the
    podFailurePolicy keeps a drain from counting against backoffLimit)."""
    proc = subprocess.Popen(
        container_command(tmp_path, 1, "stop"),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready-0").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the fake learner did not start"
            )
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert (tmp_path / "stopped-0").exists(), "the rank was killed instead of stopping on SIGTERM"


def test_a_refused_checkpoint_outranks_other_failures() -> None:
    assert (
        container_exit_code([EXIT_NOT_THE_LEARNER, EXIT_CHECKPOINT_REFUSED, -15])
        == EXIT_CHECKPOINT_REFUSED
    )
    assert container_exit_code([1, EXIT_NOT_THE_LEARNER]) == EXIT_NOT_THE_LEARNER
    assert container_exit_code([-9]) == 1  # a rank killed by a signal (OOM): a crash, retried
    assert (
        container_exit_code([EXIT_BAD_CONFIG, 5]) == EXIT_BAD_CONFIG
    )  # every rank reads the same configuration
    assert container_exit_code([5, 6]) == 1
