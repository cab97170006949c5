"""`dapo run --in-process`: the algorithm on one page (services/run/inprocess.py) trains the tiny
preset in one process, evaluates, and writes its summary and the final weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contracts.config import load_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def test_in_process_run_trains_evaluates_and_exports(tmp_path: Path) -> None:
    out, steps = tmp_path / "run", 2
    overrides = [
        f"learner.total_steps={steps}",
        f"eval.every_steps={steps}",
        "eval.max_problems=8",
        "eval.samples_per_problem=1",
    ]
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--in-process",
        "--config",
        "configs/tiny.yaml",
        "--output-dir",
        str(out),
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    assert summary["steps"] == steps
    assert summary["groups_trained"] == steps * cfg.algorithm.train_batch_groups
    assert summary["groups_generated"] >= summary["groups_trained"]  # dynamic sampling drops some
    assert [h[0] for h in summary["eval_history"]] == [0, steps]
    assert 0.0 <= summary["eval_history"][-1][1] <= 1.0 and summary["train_tokens"] > 0
    base = load_file(str(REPO / cfg.model.path / "model.safetensors"))
    trained = load_file(str(out / "hf" / "model.safetensors"))
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base), (
        "the export holds the base weights"
    )
    assert (out / "hf" / "config.json").exists() and (out / "hf" / "tokenizer.json").exists()
