"""The learner is exact on any number of ranks: one step on the same batch with 1, 2 and 4 gloo
ranks gives the same loss, gradient norm, metrics, clipped gradient and parameters, for every
`loss_agg` mode, with uneven rows per rank and padding micro-batches (docs/algorithm.md s5), and
for a model with tied input and output embeddings.

Runs `bench/multirank_check.py` (real processes under torch.distributed.run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "multirank_check.py"), "--json", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_a_tied_embedding_model_takes_the_same_step_on_2_ranks_as_on_1(tmp_path: Path) -> None:
    """SmolLM2's shape: the output projection is the input embedding. Sharded over two ranks,
    the one matrix still gets both uses' gradient and moves as it does on one rank."""
    out = tmp_path / "report.json"
    proc = run_check(out, "--tied", "--world-sizes", "1,2", "--modes", "token-mean")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["2"]["token-mean"]
    assert r["metric_rel_diff"] < 1e-3
    assert r["grad_abs_diff"] <= 1e-3 * r["grad_abs_max"]
    assert r["param_abs_diff"] < 1e-4


def test_a_lora_step_is_the_same_on_2_ranks_as_on_1(tmp_path: Path) -> None:
    """LoRA adapters sharded over two ranks (the frozen base too): the same adapter gradients
    and the same adapters after the step as on one rank."""
    out = tmp_path / "report.json"
    proc = run_check(out, "--lora", "--world-sizes", "1,2", "--modes", "token-mean")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["2"]["token-mean"]
    assert r["metric_rel_diff"] < 1e-3
    assert r["grad_abs_diff"] <= 1e-3 * r["grad_abs_max"] and r["grad_abs_max"] > 0
    assert r["param_abs_diff"] < 1e-4


def test_one_step_is_the_same_on_1_2_and_4_ranks(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = run_check(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("max_abs_param_diff=")
    report = json.loads(out.read_text())
    assert set(report) == {"2", "4"}
    for world, modes in report.items():
        assert set(modes) == set(MODES)
        for mode, r in modes.items():
            where = f"{world} ranks, {mode}"
            assert r["metric_rel_diff"] < 1e-3, (
                f"{where}: metrics differ from 1 rank by {r['metric_rel_diff']:.2e} (relative)"
            )
            assert r["grad_abs_diff"] <= 1e-3 * r["grad_abs_max"], (
                f"{where}: clipped gradient differs by {r['grad_abs_diff']:.2e}"
            )
            assert r["param_abs_diff"] < 1e-4, (
                f"{where}: parameters differ by {r['param_abs_diff']:.2e} after one step"
            )
