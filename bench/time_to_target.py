"""Time to +25 points: the service system (`dapo run`, every service its own process) against the
in-process floor (`bench/inprocess_floor.py`), both on the tiny preset, one after the other.

Both count RL seconds the same way: from the first training step, evaluation excluded (the floor
stops its clock while it evaluates; the service evaluates on the replicas beside training, and
each round records when the weights it evaluates existed). Each side's figure is the RL seconds
of its first evaluation at least 25 points above its own base evaluation. Nothing is asserted.

    .venv/bin/python bench/time_to_target.py [--steps 300] [overrides...]

Last line: `service_over_floor=<service seconds / floor seconds>` (below 1: the services win).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from services.inprocess import seconds_to_gain  # noqa: E402

GAIN = 0.25


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for both sides, dotted.key=value"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        floor = run_floor(args.steps, args.overrides, Path(tmp) / "floor.json")
        service = run_service(args.steps, args.overrides, Path(tmp) / "service")
    floor_s, service_s = (
        seconds_to_gain(floor["eval_history"], GAIN),
        seconds_to_gain(service["eval_history"], GAIN),
    )
    ratio = service_s / floor_s if floor_s and not math.isnan(floor_s) else math.nan
    print(f"floor   (eval@step:acc@RL s): {curve(floor['eval_history'])}")
    print(f"service (eval@step:acc@RL s): {curve(service['eval_history'])}")
    print(
        f"RL seconds to +{GAIN * 100:.0f} points: service {service_s:.1f}, in-process floor "
        f"{floor_s:.1f}"
    )
    save_result(
        "time_to_target",
        {
            "steps": args.steps,
            "overrides": args.overrides,
            "floor": floor,
            "service": service,
            "floor_seconds_to_plus25": floor_s,
            "service_seconds_to_plus25": service_s,
            "service_over_floor": ratio,
        },
        args.out,
    )
    print(f"service_over_floor={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
