"""LoRA against full fine-tuning at the same sample budget: learning, weight sync, learner memory.

Runs `dapo run` on a preset twice per seed from the same base, same data, same number of steps
(so the same responses trained): once training every weight at the preset's `learner.lr`, once
with `learner.lora` at `--lora-lr`, and reports from each run:

- learning: held-out accuracy at every evaluation (avg@k, with the final round's bootstrap 95%
  interval), the gain in points over one base figure for both sides (`bench/base_figure.py`),
  and per seed, paired over problems (the same problems and per-sample seeds), the mean gain per
  RL second of LoRA over full fine-tuning with its interval (`contracts.eval_stats.compare`);
- weight sync: bytes one sync sends a replica (the exported weights or adapters) and the
  learner's mean sync time per step;
- learner: peak resident memory (sampled every second) and trained response tokens per second.

Nothing is asserted; figures only. On the tiny preset 150 steps take about 2.5 minutes a side
on 2 cores. (`bench/real_model.py learner.lora.enabled=true ...` measures the real model's LoRA
side; its full side is the preset's own run.)

    .venv/bin/python bench/lora.py [--config configs/tiny.yaml] [--steps 150] [--seeds 1]
        [--lora-lr 1e-3] [--rank 16] [--out bench/results] [overrides...]

Last line: `lora_over_full_gain=<LoRA's mean gain / full fine-tuning's mean gain>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.base_figure import base_figure  # noqa: E402
from bench.real_model import run_preset, step_figures, weight_bytes  # noqa: E402
from bench.results_file import save_result  # noqa: E402
from contracts.eval_stats import Round, compare, read_rounds  # noqa: E402


def one_run(config: str, overrides: list[str], tmp: Path, label: str, base: float) -> dict:
    run = tmp / label
    summary, wall, peaks = run_preset(run, overrides, config)
    speed = step_figures(run / "metrics.jsonl")
    history = summary["eval_history"]  # [step, accuracy, RL seconds]
    rounds = read_rounds(run)
    return {
        "overrides": overrides,
        "curve": history,
        "rounds": [r.to_json() for r in rounds],
        "gain_points": 100 * (rounds[-1].acc - base),
        "final_acc": rounds[-1].acc,
        "final_acc_ci": rounds[-1].extra.get("acc_ci"),
        "wall_s": wall,
        "sync_bytes": weight_bytes(run / "final_model"),
        "sync_s_mean": speed.get("sync_s_mean"),
        "learner_peak_rss_gib": peaks.get("learner"),
        "learner_response_tokens_per_s": speed.get("learner_response_tokens_per_s"),
        "step_s_mean": speed.get("step_s_mean"),
        "ledger_balanced": summary["ledger"]["balanced"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides for both sides")
    args = parser.parse_args()
    common = [
        f"learner.total_steps={args.steps}",
        f"eval.every_steps={args.eval_every}",
        "checkpoint.every_steps=0",
        *args.overrides,
    ]
    lora = [
        "learner.lora.enabled=true",
        f"learner.lora.rank={args.rank}",
        f"learner.lora.alpha={2 * args.rank}",
        f"learner.lr={args.lora_lr}",
    ]
    base = base_figure(args.config, args.overrides)
    sides: dict[str, list[dict]] = {"full": [], "lora": []}
    paired = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            seeded = [*common, f"learner.seed={seed}", f"rollout.seed={seed}"]
            for name, extra in (("full", []), ("lora", lora)):
                run = one_run(args.config, seeded + extra, Path(tmp), f"{name}-{seed}", base["acc"])
                sides[name].append(run)
            on, off = (
                [Round.from_json(x) for x in sides[n][-1]["rounds"]] for n in ("lora", "full")
            )
            paired.append({"seed": seed, **compare(on, off, base["per_problem"], 0.25).to_json()})
            for name in sides:
                r = sides[name][-1]
                curve = " ".join(f"{int(s)}:{a:.3f}" for s, a, _ in r["curve"])
                print(
                    f"seed {seed} {name}: {curve} (gain {r['gain_points']:+.1f}); sync "
                    f"{r['sync_bytes'] / 2**20:.2f} MiB in {r['sync_s_mean'] or 0:.3f} s; learner "
                    f"peak {r['learner_peak_rss_gib'] or 0:.2f} GiB, "
                    f"{r['learner_response_tokens_per_s'] or 0:.0f} tokens/s"
                )

    def mean(name: str, key: str) -> float:
        return statistics.fmean(float(r[key] or 0.0) for r in sides[name])

    figures = {
        "config": args.config,
        "steps": args.steps,
        "seeds": args.seeds,
        "lora_lr": args.lora_lr,
        "rank": args.rank,
        "runs": sides,
        "paired_lora_over_full": paired,
        "base": {k: v for k, v in base.items() if k != "per_problem"},
        **{
            f"{name}_{key}_mean": mean(name, key)
            for name in sides
            for key in (
                "gain_points",
                "final_acc",
                "sync_bytes",
                "sync_s_mean",
                "learner_peak_rss_gib",
                "learner_response_tokens_per_s",
            )
        },
    }
    ratio = figures["lora_gain_points_mean"] / max(figures["full_gain_points_mean"], 1e-9)
    figures["lora_over_full_gain"] = ratio
    save_result("lora", figures, args.out)
    for key in ("gain_points", "sync_bytes", "learner_peak_rss_gib"):
        print(
            f"{key}: full {figures[f'full_{key}_mean']:.3g}, LoRA {figures[f'lora_{key}_mean']:.3g}"
        )
    print(f"lora_over_full_gain={ratio:.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
