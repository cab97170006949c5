"""Tasks from the ecosystem: SmolLM2-135M-Instruct on a mixture of reasoning-gym tasks, per task.

Runs `dapo run --config configs/smollm2-135m-gym.yaml` (every service its own process; each
task's own reasoning-gym scorer in the reward stage's sandbox) once per seed (`data.seed` keeps
the sets: only `rollout.seed` and `learner.seed` change), or reads runs already made (`--run`).
From each run's evaluation rounds (`eval_rounds.jsonl`: every problem's avg@k at each round, the
rounds credited to the weights that produced them) and its evaluation set (each problem's
`data_source`: its task), reports per task and overall:

- the curve: accuracy at each round against the step and the RL seconds, with a 95% bootstrap
  interval over the task's problems;
- the gain of the last round over the first, paired problem by problem (the same problems and
  sample seeds in both rounds), with its interval;
- the run's per-task training figures from `summary.json` (accuracy, gatekeeper pass rate,
  response length).

Nothing is asserted; figures only. Results go to `bench/results/<date>-gym-mixture.json`, the
first run's per-task curves beside it (`.svg`).

    .venv/bin/python bench/gym_mixture.py [--seeds 1] [--run DIR ...] [overrides...]

Last line: `gym_mixture_gain=<mean over seeds of the overall paired gain, avg@k points>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from contracts.config import load_config  # noqa: E402
from contracts.eval_stats import EVAL_ROUNDS_FILE, accuracy_interval, read_rounds  # noqa: E402
from contracts.tasks import task_label  # noqa: E402
from learner.evaluation import eval_problems  # noqa: E402
from services.experiments.plots import write_series_svg  # noqa: E402

CONFIG = "configs/smollm2-135m-gym.yaml"


def run_seed(seed: int, out: Path, overrides: list[str]) -> Path:
    run_dir = out / f"seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        CONFIG,
        "--output-dir",
        str(run_dir),
        "--quiet",
        f"rollout.seed={seed}",
        f"learner.seed={seed}",
        *overrides,
    ]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=7200)  # a run takes about 30 min
    return run_dir


def paired_gain(first: np.ndarray, last: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Mean of last - first over problems, and its 95% bootstrap interval (problems resampled
    together in both rounds: the pairing)."""
    diff = last - first
    low, high = accuracy_interval(diff.tolist(), seed=seed)
    return float(diff.mean()), low, high


def per_task(run_dir: Path) -> dict[str, Any]:
    cfg = load_config(str(run_dir / "config.yaml"), [])
    problems, _ = eval_problems(cfg)
    tasks = np.array([task_label(p.data_source) for p in problems])
    rounds = read_rounds(run_dir / EVAL_ROUNDS_FILE)
    summary = json.loads((run_dir / "summary.json").read_text())
    out: dict[str, Any] = {"rounds": len(rounds), "tasks": {}}
    for task in [*sorted(set(tasks.tolist())), "all"]:
        mask = np.ones(len(tasks), bool) if task == "all" else tasks == task
        curve = []
        for rnd in rounds:
            acc = np.asarray(rnd.per_problem)[mask]
            low, high = accuracy_interval(acc.tolist())
            curve.append(
                {
                    "step": rnd.step,
                    "rl_seconds": rnd.rl_seconds,
                    "acc": float(acc.mean()),
                    "ci": [low, high],
                }
            )
        first = np.asarray(rounds[0].per_problem)[mask]
        last = np.asarray(rounds[-1].per_problem)[mask]
        gain, low, high = paired_gain(first, last)
        out["tasks"][task] = {
            "problems": int(mask.sum()),
            "curve": curve,
            "gain": gain,
            "gain_ci": [low, high],
            "train": summary.get("tasks", {}).get(task),
        }
    out["wall_seconds"] = summary.get("wall_seconds")
    out["steps"] = summary.get("steps")
    out["ledger"] = summary.get("ledger")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--run", action="append", default=[], help="read a finished run")
    parser.add_argument("--keep", help="keep the runs under this directory")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = [Path(r) for r in args.run]
    if not runs:
        out = Path(args.keep or tempfile.mkdtemp(prefix="gym-mixture-"))
        runs = [run_seed(seed, out, args.overrides) for seed in range(args.seeds)]
    results = {str(r): per_task(r) for r in runs}
    for name, res in results.items():
        print(f"{name}: {res['steps']} steps in {res['wall_seconds']:.0f} s")
        for task, row in res["tasks"].items():
            first, last = row["curve"][0], row["curve"][-1]
            print(
                f"  {task:<18} {row['problems']:>4} problems: "
                f"{first['acc']:.3f} ({first['ci'][0]:.3f}-{first['ci'][1]:.3f}) -> "
                f"{last['acc']:.3f} ({last['ci'][0]:.3f}-{last['ci'][1]:.3f}), paired gain "
                f"{100 * row['gain']:+.1f} ({100 * row['gain_ci'][0]:+.1f}..."
                f"{100 * row['gain_ci'][1]:+.1f}) points"
            )
    saved = save_result("gym-mixture", {"config": CONFIG, "runs": results})
    first = next(iter(results.values()))["tasks"]
    series = [
        (task, [(c["step"], c["acc"]) for c in row["curve"]])
        for task, row in first.items()
        if task != "all"
    ]
    svg = write_series_svg("held-out avg@k by task", series, saved.with_suffix(".svg"))
    print(f"curves: {svg}")
    gains = [100 * res["tasks"]["all"]["gain"] for res in results.values()]
    print(f"gym_mixture_gain={statistics.mean(gains):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
