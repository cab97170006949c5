"""One base figure per (model, evaluation set): the starting model's accuracy on every problem,
measured once with many samples and reused by every arm of a bench.

Every arm of a comparison starts from the same weights, so their first rounds measure the same
thing; measuring it in each run and subtracting each run's own noisy base (+-4 points with 100
problems x 4 samples) moved a "+25 points" crossing by whole evaluation rounds. Here the base is
`dapo eval --samples K` (default 32) over the config's evaluation set, per problem, cached under
`runs/cache/base-figures/` by the model's weights, the evaluation problems, the evaluation
settings and the engine with its dtype (a change to any of them measures again).

    .venv/bin/python bench/base_figure.py [--config configs/tiny.yaml] [--samples 32] [overrides]

Last line: `base_acc=<mean accuracy>`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from contracts.eval_stats import accuracy_interval  # noqa: E402

CACHE = REPO / "runs" / "cache" / "base-figures"
SAMPLES = 32


def _fingerprint(cfg: Any, samples: int) -> str:
    """sha256 over the model's weight files, the evaluation problems and the eval settings."""
    from learner.evaluation import eval_problems

    digest = hashlib.sha256()
    for path in sorted(Path(cfg.model.path).glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    problems, _ = eval_problems(cfg)
    digest.update(json.dumps([[p.messages, p.ground_truth] for p in problems]).encode())
    ev = cfg.eval
    settings = [samples, ev.temperature, ev.top_p, ev.seed, cfg.rollout.max_response_len]
    engine = [cfg.rollout.engine, cfg.model.dtype, cfg.rollout.stop]  # each samples differently
    digest.update(json.dumps([*settings, cfg.reward.verifier, *engine]).encode())
    return digest.hexdigest()[:16]


def base_figure(
    config: str = "configs/tiny.yaml", overrides: list[str] | None = None, samples: int = SAMPLES
) -> dict[str, Any]:
    """{"acc", "acc_ci", "per_problem", "samples", "fingerprint"}: cached, else measured."""
    from contracts.config import load_config
    from services.data.prepare import prepare

    overrides = list(overrides or [])
    cfg = prepare(load_config(REPO / config, overrides)).cfg  # the data and model exist after
    key = _fingerprint(cfg, samples)
    cached = CACHE / f"{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "base.json"
        subprocess.run(
            [
                sys.executable, "-m", "services.cli", "eval", "--config", config,
                "--samples", str(samples), "--per-problem", str(out), *overrides,
            ],
            cwd=REPO,
            check=True,
            timeout=7200,
        )  # fmt: skip
        measured = json.loads(out.read_text())
    per_problem = measured["per_problem"]
    figure = {
        "acc": sum(per_problem) / len(per_problem),
        "acc_ci": list(accuracy_interval(per_problem)),
        "per_problem": per_problem,
        "samples": samples,
        "fingerprint": key,
        "config": config,
        "overrides": overrides,
    }
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(figure))
    return figure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    figure = base_figure(args.config, args.overrides, args.samples)
    low, high = figure["acc_ci"]
    print(
        f"base figure {figure['fingerprint']}: {len(figure['per_problem'])} problems x "
        f"{figure['samples']} samples, accuracy {figure['acc']:.4f} (95% CI {low:.4f}-{high:.4f})"
    )
    print(f"base_acc={figure['acc']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
