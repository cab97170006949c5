"""Tool use: the tools demo (`configs/tiny-tools.yaml`, 3-digit x 2-digit products) trained with
the calculator and without it, for each seed (`rollout.seed`; the side that goes first
alternates). Without it (`rollout.tools.enabled=false`) the base is the same, and a call it
writes is plain text that no result follows.

Per run: the evaluation accuracy before and after (avg@k on the eval problems, with the tool
when the run has it; the final round with its bootstrap 95% interval; both sides draw the same
per-sample seeds, so their base rounds are the same round), the training responses' tool-call
rate over the steps (from the run's metrics.jsonl, `tools/call_rate`, the mean of each block of
10 steps), tool errors and
time-outs, and wall seconds. Prints each run, the medians per side and the call-rate curve of
the first seed with the tool; saves everything to bench/results/. Nothing is asserted.

    .venv/bin/python bench/tools.py [--seeds 3] [overrides...]

Last line: `final_acc_with_tools=<median>`.

`--real` instead runs the real model with the `python` tool (`configs/smollm2-135m-tools.yaml`)
once for `--steps` steps (no evaluation): per step, the share of training responses that called
the tool, tool errors and the training accuracy, and the step's sampled completions that called
it (from the run's TensorBoard text). Last line: `real_model_call_rate=<mean over the steps>`.
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
from contracts.eval_stats import read_rounds  # noqa: E402

CONFIG = "configs/tiny-tools.yaml"
BLOCK = 10
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
        rounds = read_rounds(out)
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
        "final_acc_ci": rounds[-1].extra.get("acc_ci") if rounds else None,
        "eval_set": summary.get("eval_set"),
        "call_rate_first": curve[0][1] if curve else math.nan,
        "call_rate_last": curve[-1][1] if curve else math.nan,
        "wall_s": summary["wall_seconds"],
    }


REAL_CONFIG = "configs/smollm2-135m-tools.yaml"


def tensorboard_completions(tb_dir: Path) -> list[str]:
    """Every completions table the learner wrote to TensorBoard, as markdown text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tables = []
    for events in sorted(tb_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("tensors", []):
            if "completions" in tag:
                tables += [t.tensor_proto.string_val[0].decode() for t in acc.Tensors(tag)]
    return tables


def run_real(steps: int, overrides: list[str], out_dir: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "services.cli", "run", "--config", REAL_CONFIG]
        cmd += ["--output-dir", str(out), "--quiet", f"learner.total_steps={steps}"]
        cmd += ["eval.every_steps=0", "tracking.log_completions_every=1"]
        cmd += ["tracking.completions_per_log=8", *overrides]
        subprocess.run(cmd, cwd=REPO, check=True, timeout=7200)
        summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
        lines = (out / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines if line.strip()]
        tables = tensorboard_completions(out / "tensorboard")
    per_step = [
        {
            "step": int(m["step"]),
            "call_rate": float(m.get("tools/call_rate", 0.0)),
            "calls_per_response": float(m.get("tools/calls_per_response", 0.0)),
            "tool_errors": float(m.get("tools/errors", 0.0)),
            "acc": float(m.get("rollout/acc_mean", 0.0)),
        }
        for m in metrics
        if "step" in m
    ]
    rows = [row.split(" | ") for table in tables for row in table.splitlines()]
    # The prompt shows the call format too: look for a call in the response cell only.
    calling = [r[1] for r in rows if len(r) > 2 and ("python&gt;" in r[1] or "<python>" in r[1])]
    for row in per_step:
        print(
            f"step {row['step']}: call rate {row['call_rate']:.2f}, "
            f"{row['calls_per_response']:.2f} calls a response, "
            f"tool errors {row['tool_errors']:.0f}, acc {row['acc']:.3f}"
        )
    print(f"\n{len(calling)} sampled completions called the tool; the first ones:")
    for row in calling[:3]:
        print("  " + row[:400])
    rate = statistics.mean(r["call_rate"] for r in per_step) if per_step else math.nan
    save_result(
        "tools_real",
        {
            "config": REAL_CONFIG,
            "steps": steps,
            "overrides": overrides,
            "ledger": summary["ledger"],
            "per_step": per_step,
            "completions_calling": calling[:8],
            "mean_call_rate": rate,
        },
        out_dir,
    )
    print(f"real_model_call_rate={rate:.3f}")
    return 0


def median(runs: list[dict[str, Any]], figure: str) -> float:
    values = [r[figure] for r in runs if not math.isnan(r[figure])]
    return statistics.median(values) if values else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--real", action="store_true", help=f"one run of {REAL_CONFIG}")
    parser.add_argument("--steps", type=int, default=4, help="--real: training steps")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    if args.real:
        return run_real(args.steps, args.overrides, args.out)

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
    print("\ntool-call rate of the training responses (seed 0, with tools), per 10 steps:")
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
