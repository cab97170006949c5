"""Prompt skipping: what generation costs per trained group, with and without skipping.

Runs the preset (default `configs/tiny-epochs.yaml`: 1,000 problems, about 8 epochs of
generation in 300 steps) through the services, `dapo run`, once with `algorithm.prompt_skip`
off and once on, for each seed (`rollout.seed`; the side that goes first alternates). Per run:

- groups generated per group trained: (trained + filtered + stale) / trained, from the ledger;
- prompts skipped before generation;
- generation seconds per trained response: the replicas' busy seconds (evaluation included)
  over the responses trained;
- RL seconds to the target (the first evaluation `--gain` above one base figure for both sides,
  `bench/base_figure.py`; RL seconds as `bench/time_to_target.py` counts them), and the final
  accuracy with its bootstrap 95% interval;
- wall seconds of the whole run.

Per seed, the two sides are compared problem by problem (paired evaluation: the same problems
and per-sample seeds, `contracts.eval_stats.compare`): time to the target and the mean gain per
RL second, skipping over none, each with a paired bootstrap 95% interval.

Prints each run, then the median of each figure per side, and saves everything to
bench/results/. Nothing is asserted. Last line: `generated_per_trained=<median with skipping>`.

    .venv/bin/python bench/skip.py [--config configs/tiny-epochs.yaml] [--seeds 3] [overrides...]
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
from contracts.eval_stats import Round, compare, read_rounds, seconds_to_gain  # noqa: E402

FIGURES = (
    "generated_per_trained",
    "prompts_skipped",
    "gen_s_per_trained_response",
    "rl_s_to_target",
    "final_acc",
    "wall_s",
)


def run_once(
    config: str, seed: int, skip: bool, target: float, overrides: list[str]
) -> dict[str, Any]:
    """One run; `target`: the accuracy to reach (the common base figure plus the gain)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "services.cli", "run", "--config", config]
        cmd += ["--output-dir", str(out), "--quiet", f"rollout.seed={seed}"]
        cmd += [f"algorithm.prompt_skip.enabled={str(skip).lower()}", *overrides]
        subprocess.run(cmd, cwd=REPO, check=True, timeout=3600)
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
        rounds = read_rounds(out)
    cfg = load_config(REPO / config, overrides)
    ledger = summary["ledger"]
    trained_responses = ledger["trained"] * cfg.rollout.group_size
    curve = [(r.rl_seconds, r.acc) for r in rounds]
    return {
        "seed": seed,
        "skip": skip,
        "ledger": ledger,
        "eval_history": summary["eval_history"],
        "rounds": [r.to_json() for r in rounds],
        "eval_set": summary.get("eval_set"),
        "generated_per_trained": summary["generated_per_trained"],
        "prompts_skipped": summary["prompts_skipped"],
        "gen_s_per_trained_response": summary["rollout_busy_seconds"] / trained_responses,
        "rl_s_to_target": seconds_to_gain(curve, target, 0.0),
        "base_acc": rounds[0].acc if rounds else math.nan,
        "final_acc": rounds[-1].acc if rounds else math.nan,
        "final_acc_ci": rounds[-1].extra.get("acc_ci") if rounds else None,
        "wall_s": summary["wall_seconds"],
    }


def median(runs: list[dict], figure: str) -> float:
    values = [r[figure] for r in runs if r[figure] is not None and not math.isnan(r[figure])]
    return statistics.median(values) if values else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-epochs.yaml")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--gain", type=float, default=0.25, help="target: base accuracy + gain")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    base = base_figure(args.config, args.overrides)
    target = base["acc"] + args.gain
    print(f"base figure {base['acc']:.4f}: target {target:.4f}", flush=True)

    runs, paired = [], []
    for seed in range(args.seeds):
        for skip in (seed % 2 == 1, seed % 2 == 0):  # alternate which side runs first
            run = run_once(args.config, seed, skip, target, args.overrides)
            runs.append(run)
            print(
                f"seed {seed} skip {'on ' if skip else 'off'}: "
                f"generated/trained {run['generated_per_trained']:.2f}, "
                f"skipped {run['prompts_skipped']}, "
                f"gen {run['gen_s_per_trained_response'] * 1000:.1f} ms/trained response, "
                f"+{args.gain * 100:.0f} pts at {run['rl_s_to_target']:.0f} RL s, "
                f"acc {run['base_acc']:.2f} -> {run['final_acc']:.2f}, wall {run['wall_s']:.0f} s",
                flush=True,
            )
        on, off = (
            [Round.from_json(x) for x in r["rounds"]]
            for r in sorted(runs[-2:], key=lambda r: not r["skip"])
        )
        result = compare(on, off, base["per_problem"], args.gain).to_json()
        paired.append({"seed": seed, **result})
        print(
            f"seed {seed} skip on over off (paired): time to +{args.gain * 100:.0f} pts "
            f"{result['time_ratio']:.3f} {result['time_ratio_ci']}, gain per RL s "
            f"{result['area_ratio']:.3f} {result['area_ratio_ci']}",
            flush=True,
        )
    sides = {skip: [r for r in runs if r["skip"] is skip] for skip in (False, True)}
    medians = {skip: {f: median(sides[skip], f) for f in FIGURES} for skip in (False, True)}
    print(f"\nmedians over {args.seeds} seeds ({args.config}):")
    print(f"{'':10s}" + "".join(f"{f:>28s}" for f in FIGURES))
    for skip in (False, True):
        row = "".join(f"{medians[skip][f]:28.3f}" for f in FIGURES)
        print(f"{'skip on' if skip else 'skip off':10s}{row}")
    off_s, on_s = medians[False]["rl_s_to_target"], medians[True]["rl_s_to_target"]
    save_result(
        "skip",
        {
            "config": args.config,
            "seeds": args.seeds,
            "gain": args.gain,
            "overrides": args.overrides,
            "runs": runs,
            "median_off": medians[False],
            "median_on": medians[True],
            "rl_s_to_target_on_over_off": on_s / off_s if off_s else math.nan,
            "paired": paired,
            "base": {k: v for k, v in base.items() if k != "per_problem"},
        },
        args.out,
    )
    print(f"generated_per_trained={medians[True]['generated_per_trained']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
