"""Weight-sync time against a bare broadcast of the same bytes: the tiny preset with the rollout
slowed 10x (`DAPO_FAULTS=rollout.slowdown=10`), so replicas are always mid-generation when the
learner publishes. With in-flight updates a replica takes the broadcast between two decode steps;
the learner's sync should then cost about one transfer. The bare broadcast (rank 0 to as many
receiving processes as replicas, same bytes) is measured on this machine right after the run.
Nothing is asserted.

    .venv/bin/python bench/sync_latency.py [--steps 40] [overrides...]

Last line: `sync_over_flat=<mean learner sync time / bare broadcast time>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)


def main() -> int:
    from bench.real_model import weight_bytes
    from contracts.config import load_config
    from contracts.weight_sync import flat_broadcast_seconds

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slowdown", type=float, default=10.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    replicas = load_config(REPO / "configs" / "tiny.yaml", args.overrides).rollout.replicas
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "run",
                "--config",
                "configs/tiny.yaml",
                "--output-dir",
                str(run),
                "--quiet",
                f"learner.total_steps={args.steps}",
                "eval.every_steps=0",
                "checkpoint.every_steps=0",
                *args.overrides,
            ],
            cwd=REPO,
            check=True,
            timeout=3600,
            env={**os.environ, "DAPO_FAULTS": f"rollout.slowdown={args.slowdown}"},
        )
        summary = json.loads((run / "summary.json").read_text())
        nbytes = weight_bytes(run / "final_model")
    flat = flat_broadcast_seconds(nbytes, replicas=replicas)
    sync = summary["timing"]["sync_weights_s"]
    print(
        f"rollout slowed {args.slowdown:g}x, {replicas} replicas, {nbytes / 2**20:.1f} MiB of "
        f"weights: mean learner sync {sync * 1e3:.1f} ms, bare broadcast {flat * 1e3:.1f} ms"
    )
    save_result(
        "sync_latency",
        {
            "steps": args.steps,
            "slowdown": args.slowdown,
            "bytes": nbytes,
            "mean_sync_s": sync,
            "flat_broadcast_s": flat,
            "sync_over_flat": sync / flat,
        },
        args.out,
    )
    print(f"sync_over_flat={sync / flat:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
