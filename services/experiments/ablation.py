"""`dapo ablate`: the DAPO paper's ablation ladder (its Table 1), reproduced on the user's task.

The ladder starts from naive GRPO and adds one technique per rung, in the paper's order:

    naive GRPO -> + overlong filtering -> + clip-higher -> + soft overlong punishment
               -> + token-level loss -> + dynamic sampling (= DAPO)

Each rung runs `seeds` times through the real services (`dapo run`, one subprocess per run), and
every run stops at the same budget of generated responses (`learner.sample_budget`), so a rung
that throws groups away (dynamic sampling) pays for the samples it filters. Runs live in
`<out>/<rung>/seed<k>/`; a run whose `summary.json` records a completed run is not redone, so an
interrupted ladder resumes where it stopped (an unfinished run is started again from scratch).

From each run's `summary.json`, `metrics.jsonl` and `eval_rounds.jsonl` the report takes: every
evaluation round problem by problem, credited to the responses generated up to the step whose
weights it measured; the share of groups the gatekeeper filtered; the truncation rate of generated
training responses (kept or filtered); and the policy entropy at the end. Evaluation is paired
(`eval.seed`: the same problems and per-sample seeds in every run), so every run's first round
measures the same base weights the same way: one common base for every rung. Per rung, the seeds'
rounds are pooled problem by problem, and its final accuracy, its gain over naive GRPO and its mean
gain over the base across the budget carry 95% intervals from a two-level bootstrap (the seeds,
then the problems), so they hold what varies between training runs as well as between problems;
each seed's own final accuracy is shown beside them. It writes `ablation.md`
(the table), `ablation.json` (every figure, per run and per rung) and `ablation.svg` (accuracy and
entropy against generated responses, mean and standard deviation over seeds).

This module runs the ladder, reads the runs back and holds the command; the rungs and their
overrides are in `ablation_ladder.py`, the figures of runs and rungs (the bootstrap) in
`ablation_stats.py`, and the table, the data and the plot in `ablation_report.py`.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from contracts.config import DapoConfig, load_config
from contracts.eval_stats import EVAL_ROUNDS_FILE, read_rounds
from contracts.keys import Counter
from services.experiments.ablation_ladder import LADDER, Rung, rung_overrides, seed_overrides
from services.experiments.ablation_report import Report, write_report
from services.experiments.ablation_stats import EARLY_GAIN, Ladder, RunResult, mean_over_budget

log = logging.getLogger(__name__)


# --- running ----------------------------------------------------------------------------------
def run_dir(out: Path, rung: Rung, seed: int) -> Path:
    return out / rung.key / f"seed{seed}"


def completed(path: Path) -> bool:
    """A run that finished: its summary says so and its per-step metrics were written."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        (not summary.get("interrupted"))
        and summary.get("learner_exit_code") == 0
        and (path / "metrics.jsonl").exists()
    )


def run_command(config: Path, path: Path, overrides: dict[str, str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        str(config),
        "--output-dir",
        str(path),
        "--quiet",
        *(f"{k}={v}" for k, v in overrides.items()),
    ]


def run_ladder(
    config: Path,
    out: Path,
    *,
    seeds: int,
    extra: dict[str, str],
    rungs: Sequence[Rung] = LADDER,
    runner: Callable[[list[str], Path], int] | None = None,
) -> list[Path]:
    """Every (rung, seed) run not already completed, one after another; returns the run dirs.

    `extra` (the sample budget, --quick's settings, the user's overrides) applies to every run.
    A run that fails is reported and left for the next invocation; the ladder goes on."""
    runner = runner or _run_subprocess
    paths = []
    total = len(rungs) * seeds
    for i, rung in enumerate(rungs):
        index = LADDER.index(rung)
        for seed in range(seeds):
            path = run_dir(out, rung, seed)
            paths.append(path)
            n = i * seeds + seed + 1
            if completed(path):
                log.info("[%d/%d] %s seed %d: done before, kept", n, total, rung.label, seed)
                continue
            if path.exists():
                shutil.rmtree(
                    path
                )  # an interrupted run starts again: its samples must not count twice
            overrides = {**rung_overrides(index), **seed_overrides(seed), **extra}
            cmd = run_command(config, path, overrides)
            log.info("[%d/%d] %s seed %d: %s", n, total, rung.label, seed, " ".join(cmd[3:]))
            t0 = time.monotonic()
            rc = runner(cmd, path)
            log.info(
                "[%d/%d] %s seed %d: exit %d after %.0f s",
                n,
                total,
                rung.label,
                seed,
                rc,
                time.monotonic() - t0,
            )
    return paths


def _run_subprocess(cmd: list[str], path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "run.log").open("w") as log_file:
        return subprocess.run(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, check=False
        ).returncode


# --- reading runs -----------------------------------------------------------------------------
def read_run(
    path: Path, rung: str, seed: int, *, group_size: int, gain: float, base: float | None = None
) -> RunResult:
    """One run's figures. `base`: the common base accuracy the targets are measured from (None:
    this run's own first round)."""
    summary = json.loads((path / "summary.json").read_text())
    metrics = [
        json.loads(line)
        for line in (path / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    issued_at = {int(m["step"]): float(m.get("ledger/issued", 0.0)) * group_size for m in metrics}
    issued_at[0] = 0.0
    if not (path / EVAL_ROUNDS_FILE).exists():
        raise ValueError(
            f"{path} has no {EVAL_ROUNDS_FILE}: the ladder needs every run's rounds per problem "
            "(runs from before evaluation was paired cannot be reported; run them again)"
        )
    # Each round is credited to the step whose weights produced it (Round.step).
    rounds = [r for r in read_rounds(path) if r.step in issued_at]
    if not rounds:
        raise ValueError(f"{path}: no evaluation round at a step the metrics know")
    acc_curve = [(issued_at[r.step], r.acc) for r in rounds]
    start = base if base is not None else rounds[0].acc

    def first_reaching(target: float) -> float | None:
        return next((samples for samples, acc in acc_curve if acc >= start + target - 1e-9), None)

    entropy_curve = [
        (issued_at[int(m["step"])], float(m["actor/entropy"]))
        for m in metrics
        if "actor/entropy" in m
    ]
    tail = [e for _, e in entropy_curve[-max(1, len(entropy_curve) // 10) :]]
    ledger = summary["ledger"]
    gated = ledger["trained"] + ledger["filtered"] + ledger["stale"]
    counters = summary.get("counters", {})
    judged, truncated = (
        counters.get(Counter.RESPONSES_JUDGED, 0),
        counters.get(Counter.RESPONSES_TRUNCATED, 0),
    )
    if judged:  # every generated training response, kept or filtered by the gatekeeper
        truncation = [truncated / judged]
    else:  # runs from before the gatekeeper counted responses: the trained ones only
        truncation = [
            float(m["response_length/clip_ratio"])
            for m in metrics
            if "response_length/clip_ratio" in m
        ]
    samples = int(max(issued_at.values()))
    return RunResult(
        rung=rung,
        seed=seed,
        base_acc=rounds[0].acc,
        final_acc=rounds[-1].acc,
        samples=samples,
        samples_to_target=first_reaching(gain),
        samples_to_early_target=first_reaching(EARLY_GAIN),
        filtered_share=ledger["filtered"] / gated if gated else 0.0,
        truncation_rate=statistics.fmean(truncation) if truncation else 0.0,
        final_entropy=statistics.fmean(tail) if tail else math.nan,
        wall_s=float(summary["wall_seconds"]),
        steps=int(summary["steps"]),
        acc_curve=acc_curve,
        entropy_curve=entropy_curve,
        base_problems=list(rounds[0].per_problem),
        final_problems=list(rounds[-1].per_problem),
        mean_problems=mean_over_budget(
            [x for x, _ in acc_curve], [r.per_problem for r in rounds], samples
        ),
    )


def common_base(paths: Sequence[Path]) -> tuple[float, bool]:
    """The base every target is measured from: the mean of the runs' first rounds, and whether
    they were all the same (paired evaluation of the same base weights)."""
    firsts = [read_rounds(p)[0].per_problem for p in paths if (p / EVAL_ROUNDS_FILE).exists()]
    if not firsts:
        return math.nan, False
    if len({len(f) for f in firsts}) != 1:
        raise ValueError("the runs evaluated different numbers of problems: not one ladder")
    identical = all(f == firsts[0] for f in firsts)
    return float(np.mean(firsts)), identical


def read_ladder(
    out: Path, cfg: DapoConfig, *, seeds: int, gain: float, rungs: Sequence[Rung] = LADDER
) -> Ladder:
    done = []
    for rung in rungs:
        for seed in range(seeds):
            path = run_dir(out, rung, seed)
            if completed(path):
                done.append((rung, seed, path))
            else:
                log.warning(
                    "%s seed %d did not complete (see %s): left out of the table",
                    rung.label,
                    seed,
                    path / "run.log",
                )
    base, paired = common_base([path for _, _, path in done])
    runs = [
        read_run(path, rung.key, seed, group_size=cfg.rollout.group_size, gain=gain, base=base)
        for rung, seed, path in done
    ]
    return Ladder(runs, base, paired)


# --- the command ------------------------------------------------------------------------------
QUICK = {"learner.sample_budget": 4096, "eval.every_steps": 5}
"""--quick: a quarter of the ablation preset's budget, evaluations more often."""


def ablate(
    config: Path,
    *,
    seeds: int,
    budget: int | None,
    out: Path | None,
    quick: bool,
    gain: float,
    overrides: Sequence[str],
    command: str,
    rungs: Sequence[str] | None = None,
) -> Report:
    cfg = load_config(config, list(overrides))  # a bad config fails here, before any run
    extra = dict(o.split("=", 1) for o in overrides)
    if quick:
        extra = {**{k: str(v) for k, v in QUICK.items()}, **extra}
    if budget is not None:
        extra["learner.sample_budget"] = str(budget)
    load_config(config, [f"{k}={v}" for k, v in extra.items()])  # and so does a bad budget
    if "learner.sample_budget" not in extra and cfg.learner.sample_budget is None:
        raise ValueError(
            "no sample budget: set learner.sample_budget in the config or pass --budget-samples, "
            "so every rung generates the same number of responses"
        )
    chosen = [r for r in LADDER if rungs is None or r.key in rungs]
    unknown = set(rungs or ()) - {r.key for r in LADDER}
    if unknown:
        raise ValueError(
            f"unknown rung(s) {sorted(unknown)}; the ladder is {[r.key for r in LADDER]}"
        )
    # And so does a rung the config cannot take, before the first run rather than in it: the
    # GRPO rungs switch the gatekeeper off, which a config with prompt skipping on refuses.
    for rung in chosen:
        overrides_of_rung = {**rung_overrides(LADDER.index(rung)), **extra}
        load_config(config, [f"{k}={v}" for k, v in overrides_of_rung.items()])
    out = out or Path(cfg.output_dir) / ("ablation-quick" if quick else "ablation")
    t0 = time.monotonic()
    from services.data.prepare import prepare

    prepare(cfg)  # the shared base model and data, built once before the first run's clock starts
    run_ladder(config, out, seeds=seeds, extra=extra, rungs=chosen)
    ladder = read_ladder(out, cfg, seeds=seeds, gain=gain, rungs=chosen)
    return write_report(
        ladder, out, gain=gain, command=command, wall_s=time.monotonic() - t0, rungs=chosen
    )
