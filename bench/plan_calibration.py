"""`dapo plan`'s two calibrations, with their errors: the simulation fed a measured run's
component rates against what that run measured (step time, learner and rollout idle fractions),
and the hardware model against published asynchronous-vs-synchronous speed-ups
(services/planning/published.toml, each with its source). Nothing is asserted here; the
tests hold the errors to their tolerances (tests/services/test_plan.py).

    .venv/bin/python bench/plan_calibration.py [--run-dir DIR]   (default: the committed fixture
                                                                   of a real tiny-preset run)

Last line: `published_max_abs_error=<largest |error| among the cases the model claims to explain>`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from services.planning.calibration import calibrate_run, predict_published, published_cases  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run-dir", default=str(REPO / "tests" / "fixtures" / "plan-calibration-tiny")
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    run = calibrate_run(args.run_dir)
    m, p, e = run.measured, run.predicted, run.errors()
    print(f"measured run ({args.run_dir}), {m.steps} steady steps:")
    if m.cpu_cores is not None:
        print(
            f"  learner and replicas shared {m.cpu_cores} CPU cores; simulated rates: generation "
            f"{p.gen_s_per_group:.4f} s a group (measured {m.gen_s_per_group:.4f}), learner "
            f"{p.learner_busy_s:.3f} s a step (measured {m.learner_busy_s:.3f})"
        )
    print(
        f"  step time     measured {m.step_s:.3f} s   predicted {p.step_s:.3f} s   error "
        f"{e['step_time']:+.1%}"
    )
    print(
        f"  learner idle  measured {m.learner_idle:.3f}     predicted {p.learner_idle:.3f}     "
        f"error {e['learner_idle']:+.1%} ({e['learner_idle_points']:+.3f} of wall time)"
    )
    print(
        f"  rollout idle  measured {m.rollout_idle:.3f}     predicted {p.rollout_idle:.3f}     "
        f"error {e['rollout_idle']:+.1%} ({e['rollout_idle_points']:+.3f} of wall time)"
    )
    print("published asynchronous speed-ups:")
    cases = []
    for case in published_cases():
        r = predict_published(case)
        flag = "  (outside the model)" if case.outside_the_model else ""
        print(
            f"  {case.name:52s} published {case.speedup:.2f}x  predicted {r.speedup:.2f}x  error "
            f"{r.error:+.0%}  (step: synchronous {r.sync.step_s:.0f} s, asynchronous "
            f"{r.asynchronous.step_s:.0f} s){flag}"
        )
        cases.append(
            {
                "name": case.name,
                "source": case.source,
                "published": case.speedup,
                "predicted": r.speedup,
                "error": r.error,
                "sync_step_s": r.sync.step_s,
                "async_step_s": r.asynchronous.step_s,
                "outside_the_model": case.outside_the_model,
            }
        )
    explained = [abs(c["error"]) for c in cases if not c["outside_the_model"]]
    save_result(
        "plan_calibration",
        {
            "run_dir": Path(args.run_dir).name,
            "measured": m.__dict__,
            "predicted": p.as_dict(),
            "run_errors": e,
            "published": cases,
        },
        args.out,
    )
    print(f"published_max_abs_error={max(explained):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
