"""Bad configuration fails at start, before any work, with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASES = [
    (["algorithm.clip_high=0.1"], "algorithm.clip_high=0.1 < algorithm.clip_low=0.2"),
    (["rollout.group_size=1"], "rollout.group_size=1"),
    (
        ["reward.overlong.buffer_len=4096"],
        "reward.overlong.buffer_len=4096 must be < rollout.max_response_len=16",
    ),
    (["reward.verifier=regex"], "reward.verifier='regex'"),
    (["learner.lr=0"], "learner.lr=0"),
    (["queue.max_deliveries=0"], "queue.max_deliveries=0"),
    (["model.build_tiny.num_heads=8"], "head_dim >= 32"),
    (["algorithm.train_batch_groups=10"], "must be a multiple"),
    (["rollout.engine=tensorrt"], "rollout.engine='tensorrt'"),
    (["api.port=70000"], "api.port=70000"),
    (["learner.typo=1"], "learner.typo=1: unknown key"),
]


@pytest.mark.parametrize("command", ["learner", "rollout", "reward", "gatekeeper", "api"])
def test_every_service_refuses_a_bad_config(command: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            command,
            "--config",
            "configs/tiny.yaml",
            "algorithm.clip_low=0.9",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "algorithm.clip_low=0.9" in proc.stderr


@pytest.mark.parametrize(("overrides", "expected"), CASES)
def test_dapo_run_fails_fast_naming_the_key(
    overrides: list[str], expected: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            "--config",
            "configs/tiny.yaml",
            "--output-dir",
            str(tmp_path),
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m\n")
    for path, expected in (
        (tmp_path / "absent.yaml", "cannot read config file"),
        (bad, "not valid YAML"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "learner", "--config", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and expected in proc.stderr
