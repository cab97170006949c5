"""Asynchrony measured: the tiny preset with `max_staleness` 0 (synchronous DAPO: generation and
training take turns) and 1 (generation of the next batch overlaps training), one after the other.

From the synchronous run: training time per step T_train (the learner's step, weight sync
included) and generation time per step T_gen (the rest of the step's wall time, when the learner
waits for the batch). Perfect overlap would run a step in max(T_gen, T_train) instead of
T_gen + T_train: that ratio is the ideal speed-up; the efficiency is the measured speed-up over
it. Nothing is asserted.

    .venv/bin/python bench/async_vs_sync.py [--steps 100] [overrides...]

Last line: `async_efficiency=<measured speed-up / ideal speed-up>`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)


def run(staleness: int, steps: int, overrides: list[str], out: Path) -> dict[str, float]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            "--config",
            "configs/tiny.yaml",
            "--output-dir",
            str(out),
            "--quiet",
            f"learner.total_steps={steps}",
            f"algorithm.max_staleness={staleness}",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            *overrides,
        ],
        cwd=REPO,
        check=True,
        timeout=3600,
    )
    summary = json.loads((out / "summary.json").read_text())
    return {
        **summary["timing"],
        "jobs_issued_per_step": summary["ledger"]["issued"] / max(summary["steps"], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for both runs, dotted.key=value"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(0, args.steps, args.overrides, Path(tmp) / "sync")
        asyn = run(1, args.steps, args.overrides, Path(tmp) / "async")
    t_step = 3600.0 / sync["steps_per_hour"]
    t_train = sync["step_s"]
    t_gen = max(t_step - t_train, 0.0)
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    measured = asyn["steps_per_hour"] / sync["steps_per_hour"]
    efficiency = measured / ideal
    print(
        f"max_staleness 0 (synchronous): {sync['steps_per_hour']:.0f} steps/hour; per step "
        f"{t_gen:.3f}s generating, {t_train:.3f}s training (weight sync "
        f"{sync['sync_weights_s']:.3f}s)"
    )
    print(
        f"max_staleness 1 (asynchronous): {asyn['steps_per_hour']:.0f} steps/hour; learner idle "
        f"{asyn['learner_idle_fraction']:.0%}"
    )
    print(
        f"speed-up {measured:.2f}x of an ideal {ideal:.2f}x (perfect overlap of generation and "
        "training)"
    )
    save_result(
        "async_vs_sync",
        {
            "steps": args.steps,
            "overrides": args.overrides,
            "sync": sync,
            "async": asyn,
            "t_gen_s": t_gen,
            "t_train_s": t_train,
            "ideal_speedup": ideal,
            "measured_speedup": measured,
            "efficiency": efficiency,
        },
        args.out,
    )
    print(f"async_efficiency={efficiency:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
