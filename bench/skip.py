"""Prompt skipping: what generation costs per trained group, with and without skipping.

Runs the preset (default `configs/tiny-epochs.yaml`: 1,000 problems, about 8 epochs of
generation in 300 steps) through the services, `dapo run`, once with `algorithm.prompt_skip`
off and once on, for each seed (`rollout.seed`; the side that goes first alternates). Per run:

- groups generated per group trained: (trained + filtered + stale) / trained, from the ledger;
- prompts skipped before generation;
- generation seconds per trained response: the replicas' busy seconds (evaluation included)
  over the responses trained;
- RL seconds to the target (the first evaluation `--gain` above the run's own base evaluation,
  RL seconds as `bench/time_to_target.py` counts them), and the final accuracy;
- wall seconds of the whole run.

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
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from contracts.config import load_config  # noqa: E402
from services.inprocess import seconds_to_gain  # noqa: E402

FIGURES = (
    "generated_per_trained",
    "prompts_skipped",
    "gen_s_per_trained_response",
    "rl_s_to_target",
    "final_acc",
    "wall_s",
)


def run_once(config: str, seed: int, skip: bool, gain: float, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "services.cli", "run", "--config", config]
        cmd += ["--output-dir", str(out), "--quiet", f"rollout.seed={seed}"]
        cmd += [f"algorithm.prompt_skip.enabled={str(skip).lower()}", *overrides]
        subprocess.run(cmd, cwd=REPO, check=True, timeout=3600)
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    cfg = load_config(REPO / config, overrides)
    ledger, history = summary["ledger"], summary["eval_history"]
    trained_responses = ledger["trained"] * cfg.rollout.group_size
    return {
        "seed": seed,
        "skip": skip,
        "ledger": ledger,
        "eval_history": history,
        "generated_per_trained": summary["generated_per_trained"],
        "prompts_skipped": summary["prompts_skipped"],
        "gen_s_per_trained_response": summary["rollout_busy_seconds"] / trained_responses,
        "rl_s_to_target": seconds_to_gain(history, gain),
        "base_acc": history[0][1] if history else math.nan,
        "final_acc": history[-1][1] if history else math.nan,
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

    runs = []
    for seed in range(args.seeds):
        for skip in (seed % 2 == 1, seed % 2 == 0):  # alternate which side runs first
            run = run_once(args.config, seed, skip, args.gain, args.overrides)
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
        },
        args.out,
    )
    print(f"generated_per_trained={medians[True]['generated_per_trained']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
