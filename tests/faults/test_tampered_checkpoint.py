"""A checkpoint changed on disk after it was committed, met by a learner that resumes from it:
the learner refuses it before reading a byte of it into the model, exits with its own status
(4) naming the file, and `dapo run` does not restart it in a loop (starting again would meet
the same files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.runtime import EXIT_CHECKPOINT_REFUSED
from tests.helpers import finish, start_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def test_a_resume_from_a_tampered_checkpoint_is_refused_and_not_restarted(
    tmp_path: Path, redis_url: str
) -> None:
    first = finish(
        start_run(tmp_path, redis_url, "learner.total_steps=4", "checkpoint.every_steps=2"),
        tmp_path,
    )
    assert first["steps"] == 4
    newest = tmp_path / "run" / "checkpoints" / "step_4"
    shard = sorted((newest / "state").glob("*.distcp"))[0]
    with shard.open("ab") as f:
        f.write(b"\0")  # one byte more than the manifest says

    proc = start_run(
        tmp_path, redis_url, "learner.total_steps=6", "checkpoint.every_steps=2", "--resume"
    )
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_log = (tmp_path / "dapo-run.log").read_text()
    assert proc.returncode != 0, run_log[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["learner_exit_code"] == EXIT_CHECKPOINT_REFUSED, run_log[-3000:]
    assert (
        shard.name in summary["learner_refused_checkpoint"]
    )  # what a multi-rank (torchrun) learner leaves too
    assert "learner" not in summary["restarts"]  # refused once, not restarted into the same refusal
    assert summary["steps"] == 4  # nothing trained on top of it
    learner_log = (tmp_path / "run" / "logs" / "learner.log").read_text()
    assert "refusing checkpoint" in learner_log and shard.name in learner_log, learner_log[-3000:]
    assert "Traceback" not in learner_log
