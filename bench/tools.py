"""Tool use: the tools demo (`configs/tiny-tools.yaml`, 3-digit x 2-digit products) trained with
the calculator and without it, for each seed (`rollout.seed`; the side that goes first
alternates). Without it (`rollout.tools.enabled=false`) the base is the same, and a call it
writes is plain text that no result follows.

Per run: the evaluation accuracy before and after (avg@k on the eval problems, with the tool
when the run has it), the training responses' tool-call rate over the steps (from the run's
metrics.jsonl, `tools/call_rate`, the mean of each block of 20 steps), tool errors and
time-outs, and wall seconds. Prints each run, the medians per side and the call-rate curve of
the first seed with the tool; saves everything to bench/results/. Nothing is asserted.

    .venv/bin/python bench/tools.py [--seeds 3] [overrides...]

Last line: `final_acc_with_tools=<median>`.
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

CONFIG = "configs/tiny-tools.yaml"
BLOCK = 20
FIGURES = ("base_acc", "final_acc", "call_rate_first", "call_rate_last", "wall_s")


def call_rate_curve(metrics: list[dict[str, Any]]) -> list[list[float]]:
    """[last step of the block, mean `tools/call_rate`] per block of `BLOCK` steps."""
    rates = [(int(m["step"]), float(m.get("tools/call_rate", 0.0))) for m in metrics if "step" in m]
    curve = []
    for start in range(0, len(rates), BLOCK):
        block = rates[start : start + BLOCK]
        curve.append([block[-1][0], round(sum(r for _, r in block) / len(block), 4)])
    return curve


def run_once(seed: int, tools: bool, overrides: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "services.cli", "run", "--config", CONFIG]
        cmd += ["--output-dir", str(out), "--quiet", f"rollout.seed={seed}"]
        cmd += [f"rollout.tools.enabled={str(tools).lower()}", *overrides]
        subprocess.run(cmd, cwd=REPO, check=True, timeout=3600)
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
        lines = (out / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines if line.strip()]
    history = summary["eval_history"]
    curve = call_rate_curve(metrics)
    return {
        "seed": seed,
        "tools": tools,
        "ledger": summary["ledger"],
        "eval_history": history,
        "call_rate_curve": curve,
        "tool_errors": sum(float(m.get("tools/errors", 0.0)) for m in metrics),
        "tool_timeouts": sum(float(m.get("tools/timeouts", 0.0)) for m in metrics),
        "base_acc": history[0][1] if history else math.nan,
        "final_acc": history[-1][1] if history else math.nan,
        "call_rate_first": curve[0][1] if curve else math.nan,
        "call_rate_last": curve[-1][1] if curve else math.nan,
        "wall_s": summary["wall_seconds"],
    }


def median(runs: list[dict[str, Any]], figure: str) -> float:
    values = [r[figure] for r in runs if not math.isnan(r[figure])]
    return statistics.median(values) if values else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()

    runs = []
    for seed in range(args.seeds):
        for tools in (seed % 2 == 0, seed % 2 == 1):  # alternate which side runs first
            run = run_once(seed, tools, args.overrides)
            runs.append(run)
            print(
                f"seed {seed} tools {'on ' if tools else 'off'}: "
                f"acc {run['base_acc']:.3f} -> {run['final_acc']:.3f}, "
                f"call rate {run['call_rate_first']:.2f} -> {run['call_rate_last']:.2f}, "
                f"tool errors {run['tool_errors']:.0f}, time-outs {run['tool_timeouts']:.0f}, "
                f"ledger balanced {run['ledger']['balanced']}, wall {run['wall_s']:.0f} s",
                flush=True,
            )
    sides = {tools: [r for r in runs if r["tools"] is tools] for tools in (False, True)}
    medians = {tools: {f: median(sides[tools], f) for f in FIGURES} for tools in (False, True)}
    print(f"\nmedians over {args.seeds} seeds ({CONFIG}):")
    print(f"{'':12s}" + "".join(f"{f:>18s}" for f in FIGURES))
    for tools in (False, True):
        row = "".join(f"{medians[tools][f]:18.3f}" for f in FIGURES)
        print(f"{'with tools' if tools else 'without':12s}{row}")
    first = sides[True][0]
    print("\ntool-call rate of the training responses (seed 0, with tools), per 20 steps:")
    print("  " + "  ".join(f"{step}:{rate:.2f}" for step, rate in first["call_rate_curve"]))
    save_result(
        "tools",
        {
            "config": CONFIG,
            "seeds": args.seeds,
            "overrides": args.overrides,
            "runs": runs,
            "median_without": medians[False],
            "median_with": medians[True],
        },
        args.out,
    )
    print(f"final_acc_with_tools={medians[True]['final_acc']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
