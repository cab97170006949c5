"""The in-process floor: the tiny preset's DAPO in one process, synchronously, no Redis, no weight
transfer (`services/run/inprocess.py`, the algorithm on one page). What the service system is
measured against (`bench/time_to_target.py`).

Same model, data, prompt rendering, verifier, overlong shaping, dynamic sampling, batch assembly,
trainer and settings as `configs/tiny.yaml`; only the plumbing differs. Each step samples
`rollout.prompts_per_batch` prompts at a time with the transformers engine until
`train_batch_groups` groups with mixed accuracy are in hand (dynamic sampling, generation
batches of the same size as a replica's), takes one DAPO step, and copies the new weights into
the engine (a memory copy, not a transfer). Both cores serve whichever phase runs. Every
`eval.every_steps` steps it evaluates avg@k on the eval set's distinct problems (the same
`dapo eval` code), with the clock stopped: RL seconds count generation, scoring and training only.

    .venv/bin/python bench/inprocess_floor.py [--steps 300] [--json out.json] [overrides...]

Last line: `floor_seconds_to_plus25=<RL seconds to +25 points of eval accuracy>` (nan if never).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(steps: int, overrides: list[str]) -> dict[str, Any]:
    import torch

    from contracts.config import load_config
    from services.run.inprocess import run_in_process

    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"learner.total_steps={steps}", *overrides])
    torch.set_num_threads(2)  # one process: both cores for whichever phase runs

    def report(step: int, acc: float, rl_s: float) -> None:
        print(f"step {step}: eval {acc:.3f} at {rl_s:.1f} RL seconds", flush=True)

    result = run_in_process(cfg, on_eval=report)
    return {
        "eval_history": result.eval_history,
        "rounds": [r.to_json() for r in result.rounds],
        "rl_seconds": result.rl_seconds,
        "steps": result.steps,
        "groups_generated": result.groups_generated,
        "groups_trained": result.groups_trained,
        "seconds_to_plus25": result.seconds_to_gain(0.25),
        "train_tokens_per_s": result.train_tokens_per_s,
        "train_seconds": result.train_seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    result = run(args.steps, args.overrides)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(
        f"{result['steps']} steps in {result['rl_seconds']:.0f} RL seconds; eval "
        f"{result['eval_history'][0][1]:.3f} -> {result['eval_history'][-1][1]:.3f}; "
        f"{result['groups_generated']} groups generated for {result['groups_trained']} trained"
    )
    print(f"floor_seconds_to_plus25={result['seconds_to_plus25']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
