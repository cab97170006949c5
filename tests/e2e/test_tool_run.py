"""End to end with tools (`rollout.tools`): `dapo run` on the tools preset, with a base
warm-started briefly on half tool traces so that it calls the calculator from the start. The
replicas run the calls in their sandboxes, the trajectories train, and the ledger balances (one
group is one job, whatever its responses called). Learning with and without the tool is measured
by `bench/tools.py`, not here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_tiny_run import REPO

pytestmark = pytest.mark.slow

STEPS = 4


def test_a_tool_run_calls_the_calculator_trains_and_balances(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "services.cli", "run", "--config", "configs/tiny-tools.yaml"]
    cmd += ["--output-dir", str(out), "--quiet"]
    cmd += [
        f"model.path={tmp_path / 'base'}",
        "model.build_tiny.sft_max_steps=150",
        f"data.train_path={tmp_path / 'train.parquet'}",
        f"data.eval_path={tmp_path / 'eval.parquet'}",
        "data.synth.num_train=2000",
        "data.synth.tool_traces=0.5",
        "data.synth.num_eval=64",  # the base and final rounds: this test asserts no accuracy
        f"learner.total_steps={STEPS}",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"dapo run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["learner_exit_code"] == 0
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["dead"] == 0
    assert ledger["trained"] == STEPS * 16
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    calls = sum(m["tools/calls_per_response"] for m in metrics)
    assert calls > 0, "no trained response called the calculator"
    assert all(m["tools/timeouts"] == 0 for m in metrics)
    # The replicas said how their sandboxes are isolated.
    logs = "".join(p.read_text() for p in (out / "logs").glob("rollout-*.log"))
    assert "tools ['calculator'] in sandboxes" in logs
