"""Time to target: the service system (`dapo run`, every service its own process) against the
in-process floor (`bench/inprocess_floor.py`), both on the tiny preset, one after the other,
`--repeats` times (the side that goes first alternates).

Both count RL seconds the same way: from the first training step, evaluation excluded. The floor
stops its clock while it evaluates. The service trains with no evaluation round on its path
(`eval.every_steps=0`: its one replica would otherwise generate 800 x 4 evaluation samples beside
the training samples, a cost the floor does not pay) and saves a checkpoint every
`eval.every_steps` of the preset; after the run each checkpoint's export is evaluated here, at the
RL seconds its trainer.json records, as `dapo eval` would
(`services.experiments.evaluation.evaluate`).
Evaluation is paired: both sides draw each evaluation sample with the seed of its problem and
index (`eval.seed`), so their rounds differ by their weights only, and both are measured from one
base figure (`bench/base_figure.py`: the base model, many samples per problem), not each run's
own first round. `--in-run-eval` measures the service with its evaluation rounds in the run
instead (each credited to the weights that produced it, `learner/evaluation.py`). Per repeat:

- the whole-run ratio: the service's RL seconds for all the steps over the floor's;
- time to +25 points over the common base, service over floor, with a paired bootstrap 95%
  interval over problems (`contracts.eval_stats.compare`);
- the mean gain over the base per RL second (the area under the accuracy curve up to the shorter
  run's end), service over floor, with its interval: every round counts, not one crossing.

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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.base_figure import base_figure  # noqa: E402  (a module beside this script)
from bench.results_file import save_result  # noqa: E402
from contracts.config import load_config  # noqa: E402
from contracts.eval_stats import Round, compare, read_rounds  # noqa: E402

CONFIG = "configs/tiny.yaml"
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


def run_service(steps: int, overrides: list[str], out: Path, *, in_run_eval: bool) -> dict:
    every = load_config(REPO / CONFIG, overrides).eval.every_steps
    offline = [
        "eval.every_steps=0",
        f"checkpoint.every_steps={every}",
        f"checkpoint.keep_last={steps // every + 2}",
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            "--config",
            CONFIG,
            "--output-dir",
            str(out),
            "--quiet",
            f"learner.total_steps={steps}",
            *overrides,
            *([] if in_run_eval else offline),
        ],
        cwd=REPO,
        check=True,
        timeout=3600,
    )
    summary = json.loads((out / "summary.json").read_text())
    rounds = read_rounds(out)
    if not in_run_eval:  # the base and final rounds ran in the run; the rest from checkpoints
        rounds = sorted(
            [rounds[0], *checkpoint_rounds(out / "checkpoints", overrides), rounds[-1]],
            key=lambda r: r.rl_seconds,
        )
    history = [[r.step, r.acc, r.rl_seconds] for r in rounds]
    return {
        "eval_history": history,
        "rounds": [r.to_json() for r in rounds],
        "wall_seconds": summary["wall_seconds"],
        "ledger": summary["ledger"],
        "eval_set": summary.get("eval_set"),
        "in_run_eval": in_run_eval,
    }


def checkpoint_rounds(store: Path, overrides: list[str]) -> list[Round]:
    """A round for each checkpoint of the store but the last (the run's final round measured
    that one), evaluated in this process with the run's evaluation settings and seeds
    (`services.experiments.evaluation.evaluate_checkpoints`, as `dapo eval --run`
    does)."""
    import torch
    from transformers import AutoTokenizer

    from rollout.engine import make_engine
    from services.experiments.evaluation import eval_prompts, evaluate_checkpoints

    torch.set_num_threads(2)
    cfg = load_config(REPO / CONFIG, overrides)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    records, prompts = eval_prompts(cfg, tokenizer)
    engine = make_engine(cfg)
    try:
        rounds = evaluate_checkpoints(engine, tokenizer, records, prompts, cfg, store)
    finally:
        engine.close()
    return rounds[:-1]


def curve(history: list[list[float]]) -> str:
    return " ".join(f"{int(step)}:{acc:.2f}@{rl:.0f}s" for step, acc, rl in history)


def rl_seconds(history: list[list[float]]) -> float:
    """RL seconds of the last evaluation (the one after the last step)."""
    return history[-1][2] if history else math.nan


def ratios(floor: dict, service: dict, base: list[float]) -> dict[str, Any]:
    """The service over the floor: whole run; time to +25 points and gain per RL second, paired
    over problems against the common base."""
    paired = compare(
        [Round.from_json(r) for r in service["rounds"]],
        [Round.from_json(r) for r in floor["rounds"]],
        base,
        GAIN,
    )
    return {
        "whole_run": rl_seconds(service["eval_history"]) / rl_seconds(floor["eval_history"]),
        "at_plus25": paired.time_ratio,
        "at_plus25_ci": list(paired.time_ratio_ci),
        "gain_per_rl_second": paired.area_ratio,
        "gain_per_rl_second_ci": list(paired.area_ratio_ci),
        "floor_seconds_to_plus25": paired.seconds_b,
        "service_seconds_to_plus25": paired.seconds_a,
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
        "--in-run-eval",
        action="store_true",
        help="the service evaluates in the run, on its replica, instead of from checkpoints",
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for both sides, dotted.key=value"
    )
    args = parser.parse_args()
    base = base_figure(CONFIG, args.overrides)
    print(
        f"base figure: {base['acc']:.4f} (95% CI {base['acc_ci'][0]:.4f}-{base['acc_ci'][1]:.4f}"
        f"), {len(base['per_problem'])} problems x {base['samples']} samples",
        flush=True,
    )
    repeats = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            sides = {}
            for side in ("floor", "service") if i % 2 == 0 else ("service", "floor"):
                if side == "floor":
                    sides[side] = run_floor(args.steps, args.overrides, Path(tmp) / "floor.json")
                else:
                    sides[side] = run_service(
                        args.steps,
                        args.overrides,
                        Path(tmp) / "service",
                        in_run_eval=args.in_run_eval,
                    )
        figures = ratios(sides["floor"], sides["service"], base["per_problem"])
        repeats.append({**sides, **figures})
        print(f"repeat {i}: floor   (eval@step:acc@RL s): {curve(sides['floor']['eval_history'])}")
        print(
            f"repeat {i}: service (eval@step:acc@RL s): {curve(sides['service']['eval_history'])}"
        )
        t_low, t_high = figures["at_plus25_ci"]
        a_low, a_high = figures["gain_per_rl_second_ci"]
        print(
            f"repeat {i}: service over floor: whole run {figures['whole_run']:.3f}, at +25 points "
            f"{figures['at_plus25']:.3f} ({t_low:.3f}-{t_high:.3f}), gain per RL second "
            f"{figures['gain_per_rl_second']:.3f} ({a_low:.3f}-{a_high:.3f})",
            flush=True,
        )
    medians = {
        key: nan_median([r[key] for r in repeats])
        for key in ("whole_run", "at_plus25", "gain_per_rl_second")
    }
    print(
        f"medians of {args.repeats}: whole run {medians['whole_run']:.3f}, at +25 points "
        f"{medians['at_plus25']:.3f}, gain per RL second {medians['gain_per_rl_second']:.3f}"
    )
    first = repeats[0]
    save_result(
        "time_to_target",
        {
            "steps": args.steps,
            "repeats": args.repeats,
            "in_run_eval": args.in_run_eval,
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
            "service_over_floor_gain_per_rl_second": medians["gain_per_rl_second"],
            "base": {k: v for k, v in base.items() if k != "per_problem"},
        },
        args.out,
    )
    print(f"service_over_floor_whole_run={medians['whole_run']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
