"""Time to target: the service system (`dapo run`, every service its own process) against the
in-process floor (`bench/inprocess_floor.py`), both on the tiny preset, one after the other,
`--repeats` times (the side that goes first alternates).

Both count RL seconds the same way: from the first training step, evaluation excluded (the floor
stops its clock while it evaluates; the service evaluates on the replicas beside training, and
each round records when the weights it evaluates existed). Per repeat:

- the whole-run ratio: the service's RL seconds for all the steps over the floor's;
- the median over gains: for each gain of +15 to +45 points (every 5) that both sides reached,
  the ratio of the RL seconds of their first evaluation that far above their own base, and the
  median of those ratios (one crossing alone swings with 100 evaluation problems);
- the ratio at +25 points.

Each figure's median over the repeats is reported. Nothing is asserted.

    .venv/bin/python bench/time_to_target.py [--steps 300] [--repeats 3] [overrides...]

Last line: `service_over_floor_whole_run=<median whole-run ratio>` (below 1: the services win).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from services.inprocess import seconds_to_gain  # noqa: E402

GAIN = 0.25
GAINS = (0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.45)


def run_floor(steps: int, overrides: list[str], out: Path) -> dict:
    subprocess.run(
        [
            sys.executable,
            "bench/inprocess_floor.py",
            "--steps",
            str(steps),
            "--json",
            str(out),
            *overrides,
        ],
        cwd=REPO,
        check=True,
        timeout=3600,
    )
    return json.loads(out.read_text())


def run_service(steps: int, overrides: list[str], out: Path) -> dict:
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
            *overrides,
        ],
        cwd=REPO,
        check=True,
        timeout=3600,
    )
    summary = json.loads((out / "summary.json").read_text())
    return {
        "eval_history": summary["eval_history"],
        "wall_seconds": summary["wall_seconds"],
        "ledger": summary["ledger"],
    }


def curve(history: list[list[float]]) -> str:
    return " ".join(f"{int(step)}:{acc:.2f}@{rl:.0f}s" for step, acc, rl in history)


def rl_seconds(history: list[list[float]]) -> float:
    """RL seconds of the last evaluation (the one after the last step)."""
    return history[-1][2] if history else math.nan


def ratios(floor: dict, service: dict) -> dict[str, float]:
    """The service over the floor: whole run, median over gains, at +25 points."""
    at_gain = []
    for gain in GAINS:
        f, s = (
            seconds_to_gain(floor["eval_history"], gain),
            seconds_to_gain(service["eval_history"], gain),
        )
        if f > 0 and not math.isnan(f) and not math.isnan(s):
            at_gain.append(s / f)
    floor_s, service_s = (
        seconds_to_gain(floor["eval_history"], GAIN),
        seconds_to_gain(service["eval_history"], GAIN),
    )
    return {
        "whole_run": rl_seconds(service["eval_history"]) / rl_seconds(floor["eval_history"]),
        "median_over_gains": statistics.median(at_gain) if at_gain else math.nan,
        "at_plus25": service_s / floor_s if floor_s and not math.isnan(floor_s) else math.nan,
        "floor_seconds_to_plus25": floor_s,
        "service_seconds_to_plus25": service_s,
    }


def nan_median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for both sides, dotted.key=value"
    )
    args = parser.parse_args()
    repeats = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            sides = {}
            for side in ("floor", "service") if i % 2 == 0 else ("service", "floor"):
                if side == "floor":
                    sides[side] = run_floor(args.steps, args.overrides, Path(tmp) / "floor.json")
                else:
                    sides[side] = run_service(args.steps, args.overrides, Path(tmp) / "service")
        figures = ratios(sides["floor"], sides["service"])
        repeats.append({**sides, **figures})
        print(f"repeat {i}: floor   (eval@step:acc@RL s): {curve(sides['floor']['eval_history'])}")
        print(
            f"repeat {i}: service (eval@step:acc@RL s): {curve(sides['service']['eval_history'])}"
        )
        print(
            f"repeat {i}: service over floor: whole run {figures['whole_run']:.3f}, median over "
            f"gains {figures['median_over_gains']:.3f}, at +25 points {figures['at_plus25']:.3f}",
            flush=True,
        )
    medians = {
        key: nan_median([r[key] for r in repeats])
        for key in ("whole_run", "median_over_gains", "at_plus25")
    }
    print(
        f"medians of {args.repeats}: whole run {medians['whole_run']:.3f}, median over gains "
        f"{medians['median_over_gains']:.3f}, at +25 points {medians['at_plus25']:.3f}"
    )
    first = repeats[0]
    save_result(
        "time_to_target",
        {
            "steps": args.steps,
            "repeats": args.repeats,
            "overrides": args.overrides,
            "floor": first["floor"],
            "service": first["service"],
            "runs": repeats,
            "floor_seconds_to_plus25": nan_median([r["floor_seconds_to_plus25"] for r in repeats]),
            "service_seconds_to_plus25": nan_median(
                [r["service_seconds_to_plus25"] for r in repeats]
            ),
            "service_over_floor": medians["at_plus25"],
            "service_over_floor_whole_run": medians["whole_run"],
            "service_over_floor_median_over_gains": medians["median_over_gains"],
        },
        args.out,
    )
    print(f"service_over_floor_whole_run={medians['whole_run']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
