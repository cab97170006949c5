"""`dapo ablate` end to end: two rungs of the ladder through the real services, then the report.

Small on purpose (a briefly warm-started base, a budget of 4 training steps): what is checked is
that each rung ran the configuration it names, stopped at the sample budget with its ledger
balanced, and that the table, the data and the plot describe those runs. The full ladder's
figures come from `dapo ablate` itself (bench/results/).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BUDGET = 512  # responses: 4 steps of 16 groups x 8 without filtering


@pytest.mark.slow
def test_two_rungs_run_to_the_budget_and_are_reported(tmp_path: Path) -> None:
    out = tmp_path / "ladder"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "ablate",
        "--config",
        "configs/ablation.yaml",
        "--seeds",
        "1",
        "--rungs",
        "grpo,dapo",
        "--budget-samples",
        str(BUDGET),
        "--out",
        str(out),
        # A base warm-started for a few steps on a small data set keeps the test short; it need
        # not be good, only the same for both rungs.
        f"model.path={tmp_path}/base",
        "model.build_tiny.sft_max_steps=60",
        f"data.train_path={tmp_path}/train.parquet",
        f"data.eval_path={tmp_path}/eval.parquet",
        "data.synth.num_train=2000",
        "data.synth.num_eval=20",
        "eval.every_steps=2",
        "eval.samples_per_problem=2",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    for rung, gatekeeper, loss_agg in (
        ("grpo", False, "seq-mean-token-mean"),
        ("dapo", True, "token-mean"),
    ):
        run = out / rung / "seed0"
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert (
            cfg["algorithm"]["gatekeeper"] is gatekeeper
            and cfg["algorithm"]["loss_agg"] == loss_agg
        )
        assert cfg["learner"]["sample_budget"] == BUDGET
        summary = json.loads((run / "summary.json").read_text())
        assert summary["ledger"]["balanced"] and summary["learner_exit_code"] == 0
        issued = summary["ledger"]["issued"] * cfg["rollout"]["group_size"]
        assert issued >= BUDGET  # it ran until the budget was spent ...
        assert (
            summary["steps"] < cfg["learner"]["total_steps"]
        )  # ... which ended it, not total_steps

    data = json.loads((out / "ablation.json").read_text())
    by_rung = {r["rung"]: r for r in data["runs"]}
    assert set(by_rung) == {"grpo", "dapo"}
    assert by_rung["grpo"]["filtered_share"] == 0.0  # no dynamic sampling: every group trained
    # The budget counts responses requested, and admission control requests up to two batches
    # ahead of the learner: at most BUDGET / 128 steps, fewer by the look-ahead.
    assert 1 <= by_rung["grpo"]["steps"] <= BUDGET // (16 * 8)
    assert by_rung["dapo"]["steps"] <= by_rung["grpo"]["steps"]  # filtered groups cost samples too
    table = (out / "ablation.md").read_text()
    assert "| naive GRPO | 1 |" in table and "| + dynamic sampling (DAPO) | 1 |" in table
    assert (out / "ablation.svg").stat().st_size > 10_000
    assert "ablation.md" in done.stdout  # the command prints where the report is
