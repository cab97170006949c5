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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from contracts.config import DapoConfig, load_config
from contracts.eval_stats import EVAL_ROUNDS_FILE, read_rounds
from contracts.keys import Counter
from services.experiments.provenance import provenance

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rung:
    key: str
    """Directory name and table key."""
    label: str
    adds: dict[str, str]
    """The overrides this rung adds to the one before it."""
    why: str
    """What the technique should change on a task that exercises it."""


NAIVE_GRPO = {
    "algorithm.clip_high": "0.2",  # symmetric clip: epsilon_high = epsilon_low
    "algorithm.loss_agg": "seq-mean-token-mean",  # sample-level loss
    "algorithm.gatekeeper": "false",  # no dynamic sampling
    "reward.overlong.enabled": "false",  # no soft overlong punishment
    "reward.overlong.filter": "false",  # no overlong filtering
}
"""GRPO as the paper's first row: symmetric clip 0.2, sample-level loss, every group trained,
truncated responses scored like any other. Everything else (no KL, the +-1 rule reward, the
learning rate, batch sizes) stays the config's."""

LADDER: tuple[Rung, ...] = (
    Rung("grpo", "naive GRPO", {}, "the baseline"),
    Rung(
        "overlong_filter",
        "+ overlong filtering",
        {"reward.overlong.filter": "true"},
        "truncated responses stop teaching 'wrong' to reasoning that was cut off rather than "
        "mistaken",
    ),
    Rung(
        "clip_higher",
        "+ clip-higher",
        {"algorithm.clip_high": "0.28"},
        "low-probability tokens can gain more per update, which keeps entropy from collapsing",
    ),
    Rung(
        "soft_overlong",
        "+ soft overlong punishment",
        {"reward.overlong.enabled": "true"},
        "responses that run into the last buffer_len tokens lose reward in proportion, steering "
        "length",
    ),
    Rung(
        "token_loss",
        "+ token-level loss",
        {"algorithm.loss_agg": "token-mean"},
        "every token weighs the same, so long responses count fully and long bad patterns are "
        "punished",
    ),
    Rung(
        "dapo",
        "+ dynamic sampling (DAPO)",
        {"algorithm.gatekeeper": "true"},
        "all-correct and all-wrong groups (zero advantage) stop diluting the batch",
    ),
)


def rung_overrides(index: int) -> dict[str, str]:
    """The full overrides of rung `index`:
    naive GRPO plus every technique up to and including it."""
    out = dict(NAIVE_GRPO)
    for rung in LADDER[: index + 1]:
        out.update(rung.adds)
    return out


EARLY_GAIN = 0.10
"""A second, nearer target the table reports beside `gain`: at toy scale and a fixed budget not
every rung gets to +25 points, and how early each starts to learn still tells rungs apart."""


@dataclass
class RunResult:
    """What the table needs from one run."""

    rung: str
    seed: int
    base_acc: float
    """The run's first round (the base weights); the same in every run when evaluation is
    paired."""
    final_acc: float
    samples: int
    """Responses requested for training over the run (issued prompt jobs x group size)."""
    samples_to_target: float | None
    """Responses generated when an evaluation first reached the common base + gain; None: not
    reached."""
    samples_to_early_target: float | None
    """The same for base + EARLY_GAIN (10 points): how fast a rung starts learning."""
    filtered_share: float
    truncation_rate: float
    final_entropy: float
    wall_s: float
    steps: int
    acc_curve: list[tuple[float, float]] = field(default_factory=list)
    """(responses generated, eval accuracy) of every evaluation round."""
    entropy_curve: list[tuple[float, float]] = field(default_factory=list)
    """(responses generated, mean token entropy of the step's training batch)."""
    base_problems: list[float] = field(default_factory=list, repr=False)
    """Per-problem accuracy of the first round (the report's common base)."""
    final_problems: list[float] = field(default_factory=list, repr=False)
    """Per-problem accuracy of the last round."""
    mean_problems: list[float] = field(default_factory=list, repr=False)
    """Per-problem accuracy averaged over the budget (`mean_over_budget`)."""

    def to_json(self) -> dict[str, object]:
        """Every figure but the per-problem lists (the rung statistics summarise them)."""
        out = asdict(self)
        for key in ("base_problems", "final_problems", "mean_problems"):
            out.pop(key)
        return out


def mean_over_budget(
    xs: Sequence[float], per_problem: Sequence[Sequence[float]], end: float
) -> list[float]:
    """Each problem's accuracy averaged over generated responses from the first round to `end`
    (the budget): each round's accuracy holds until the next round (the area under the step-wise
    curve over its length). Linear in the rounds, so the pooled statistics resample it like an
    accuracy. A second measure beside the final round: it counts how early a rung learned."""
    rounds = np.asarray(per_problem, dtype=float)
    bounds = np.asarray([*xs[1:], end], dtype=float)
    widths = np.clip(bounds - np.asarray(xs, dtype=float), 0.0, None)
    if widths.sum() <= 0:
        return [float(v) for v in rounds[-1]]
    return [float(v) for v in widths @ rounds / widths.sum()]


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


def seed_overrides(seed: int) -> dict[str, str]:
    """A seed changes the data order, the learner's and the replicas' randomness; never the base
    model or the evaluation set, which every rung shares."""
    return {"data.seed": str(seed), "learner.seed": str(seed), "rollout.seed": str(seed)}


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


@dataclass
class Ladder:
    """The completed runs of a ladder, read against one common base."""

    runs: list[RunResult]
    base: float
    """Accuracy of the base weights: the mean of the runs' first rounds."""
    paired: bool
    """Every run's first round was the same, problem by problem (paired evaluation)."""


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


# --- the report -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RungStats:
    """A rung's seeds pooled problem by problem (each problem's accuracy averaged over the
    seeds' rounds), with 95% intervals from a two-level bootstrap: each resample draws the
    rung's seeds with replacement and then the problems (the same problems for every rung, so
    comparisons are paired). The interval so counts both what varies between training runs and
    what varies between evaluation problems."""

    rung: str
    runs: int
    final: float
    final_ci: tuple[float, float]
    seeds_final: list[float]
    vs_first: float | None
    """Final accuracy minus the first rung's (naive GRPO's), paired over problems."""
    vs_first_ci: tuple[float, float] | None
    mean_gain: float
    """Accuracy averaged over the budget minus the common base (`mean_over_budget`)."""
    mean_gain_ci: tuple[float, float]


def _resampled(per_seed: np.ndarray, problems: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(resamples,) mean accuracy of a rung under the two-level bootstrap: per resample, its
    seeds drawn with replacement, each seed's accuracy over that resample's problems."""
    by_seed = per_seed[:, problems].mean(axis=2)  # (seeds, resamples)
    seeds, resamples = by_seed.shape
    drawn = rng.integers(0, seeds, size=(resamples, seeds))
    out: np.ndarray = by_seed[drawn, np.arange(resamples)[:, None]].mean(axis=1)
    return out


def _interval95(values: np.ndarray) -> tuple[float, float]:
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))


def rung_stats(
    ladder: Ladder, rungs: Sequence[Rung] = LADDER, *, resamples: int = 2000, seed: int = 0
) -> list[RungStats]:
    """One `RungStats` per rung that has runs; the first rung with runs is the reference."""
    if not ladder.runs:
        return []
    base = np.mean([r.base_problems for r in ladder.runs], axis=0)
    rng = np.random.default_rng(seed)
    problems = rng.integers(0, base.size, size=(resamples, base.size))
    per_rung = {}
    for rung in rungs:
        rows = [r for r in ladder.runs if r.rung == rung.key]
        if rows:
            finals = np.asarray([r.final_problems for r in rows])
            gains = np.asarray([r.mean_problems for r in rows]) - base
            per_rung[rung.key] = (
                rows,
                finals,
                gains,
                _resampled(finals, problems, rng),
                _resampled(gains, problems, rng),
            )
    first = next(iter(per_rung))
    out = []
    for key, (rows, finals, gains, final_draws, gain_draws) in per_rung.items():
        reference = per_rung[first]
        vs = None if key == first else float(finals.mean() - reference[1].mean())
        out.append(
            RungStats(
                rung=key,
                runs=len(rows),
                final=float(finals.mean()),
                final_ci=_interval95(final_draws),
                seeds_final=[r.final_acc for r in rows],
                vs_first=vs,
                vs_first_ci=None if vs is None else _interval95(final_draws - reference[3]),
                mean_gain=float(gains.mean()),
                mean_gain_ci=_interval95(gain_draws),
            )
        )
    return out


def _mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) / scale
    std = statistics.stdev(values) / scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _reached(samples: Sequence[float | None]) -> str:
    """Mean ± std over the runs that reached a target, and how many did
    ("not reached" is counted)."""
    hit = [s for s in samples if s is not None]
    if not hit:
        return f"not reached (0/{len(samples)})"
    return f"{_mean_std(hit, 1000, 1)} ({len(hit)}/{len(samples)})"


def _points(value: float, ci: tuple[float, float]) -> str:
    """A difference of accuracies in points with its interval: `+7.0 (+4.1..+9.8)`."""
    low, high = (round(v * 100, 1) + 0.0 for v in ci)  # + 0.0: no "-0.0" from rounding
    return f"{round(value * 100, 1) + 0.0:+.1f} ({low:+.1f}..{high:+.1f})"


def table(ladder: Ladder, *, gain: float, rungs: Sequence[Rung] = LADDER) -> str:
    first = next((r.label for r in rungs if any(x.rung == r.key for x in ladder.runs)), "-")
    head = (
        "| rung | runs | final accuracy (95% CI) | seeds | "
        f"vs {first}, points (95% CI) | mean gain over the budget, points (95% CI) "
        f"| responses to base + {EARLY_GAIN * 100:.0f} pts (k) "
        f"| responses to base + {gain * 100:.0f} pts (k) | groups filtered | truncated "
        "| entropy at end | wall s / run |"
    )
    lines = [head, "|" + "---|" * 12]
    stats = {st.rung: st for st in rung_stats(ladder, rungs)}
    for rung in rungs:
        rows = [r for r in ladder.runs if r.rung == rung.key]
        if not rows:
            lines.append(f"| {rung.label} | 0 |" + " - |" * 10)
            continue
        st = stats[rung.key]
        vs = (
            "-"
            if st.vs_first is None or st.vs_first_ci is None
            else (_points(st.vs_first, st.vs_first_ci))
        )
        lines.append(
            f"| {rung.label} | {len(rows)} "
            f"| {st.final:.3f} ({st.final_ci[0]:.3f}-{st.final_ci[1]:.3f}) "
            f"| {' '.join(f'{a:.2f}' for a in st.seeds_final)} "
            f"| {vs} | {_points(st.mean_gain, st.mean_gain_ci)} "
            f"| {_reached([r.samples_to_early_target for r in rows])} "
            f"| {_reached([r.samples_to_target for r in rows])} "
            f"| {_mean_std([r.filtered_share for r in rows], digits=2)} "
            f"| {_mean_std([r.truncation_rate for r in rows])} "
            f"| {_mean_std([r.final_entropy for r in rows])} "
            f"| {statistics.fmean(r.wall_s for r in rows):.0f} |"
        )
    return "\n".join(lines)


def _on_grid(
    curves: Sequence[list[tuple[float, float]]], grid: Sequence[float]
) -> list[list[float]]:
    """Each curve linearly interpolated at the grid points inside its own range (NaN outside)."""
    import numpy as np

    out = []
    for curve in curves:
        pts = sorted((x, y) for x, y in curve if not math.isnan(x))
        if not pts:
            out.append([math.nan] * len(grid))
            continue
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        values = np.interp(grid, xs, ys, left=math.nan, right=math.nan)
        out.append([float(v) for v in values])
    return out


def plot(
    results: Sequence[RunResult],
    path: Path,
    *,
    rungs: Sequence[Rung] = LADDER,
    points: int = 24,
    base: float | None = None,
) -> None:
    """Two panels against generated responses: eval accuracy and policy entropy, per rung the mean
    over seeds (curves interpolated onto a common grid) with a band/bars of one standard
    deviation."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (acc_ax, ent_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    top = max((r.samples for r in results), default=1)
    grid = [top * i / (points - 1) for i in range(points)]
    for rung in rungs:
        rows = [r for r in results if r.rung == rung.key]
        if not rows:
            continue
        for ax, curves in (
            (acc_ax, [r.acc_curve for r in rows]),
            (ent_ax, [r.entropy_curve for r in rows]),
        ):
            values = _on_grid(curves, grid)
            xs, means, stds = [], [], []
            for j, g in enumerate(grid):
                col = [v[j] for v in values if not math.isnan(v[j])]
                if col:
                    xs.append(g / 1000)
                    means.append(statistics.fmean(col))
                    stds.append(statistics.stdev(col) if len(col) > 1 else 0.0)
            if ax is acc_ax:
                ax.errorbar(xs, means, yerr=stds, label=rung.label, capsize=2, linewidth=1.4)
            else:
                ax.plot(xs, means, label=rung.label, linewidth=1.4)
                ax.fill_between(
                    xs,
                    [m - s for m, s in zip(means, stds, strict=True)],
                    [m + s for m, s in zip(means, stds, strict=True)],
                    alpha=0.15,
                )
    if base is not None and not math.isnan(base):
        acc_ax.axhline(base, color="grey", linestyle=":", linewidth=1, label="base weights")
    acc_ax.set(
        title="evaluation accuracy (mean ± std over seeds)",
        xlabel="generated responses (thousands)",
        ylabel="avg@k accuracy",
    )
    ent_ax.set(
        title="policy entropy of training batches",
        xlabel="generated responses (thousands)",
        ylabel="mean token entropy (nats)",
    )
    for ax in (acc_ax, ent_ax):
        ax.grid(alpha=0.3)
    acc_ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@dataclass
class Report:
    markdown: Path
    data: Path
    figure: Path


def write_report(
    ladder: Ladder,
    out: Path,
    *,
    gain: float,
    command: str,
    wall_s: float,
    rungs: Sequence[Rung] = LADDER,
) -> Report:
    md, data, fig = out / "ablation.md", out / "ablation.json", out / "ablation.svg"
    results = ladder.runs
    plot(results, fig, rungs=rungs, base=ladder.base)
    why = "\n".join(f"- **{r.label}**: {r.why}." for r in rungs)
    made = provenance()
    problems = len(results[0].final_problems) if results else 0
    paired = (
        "every run's first round was the same, problem by problem (paired evaluation)"
        if ladder.paired
        else "the runs' first rounds differed (evaluation not paired: the base is their mean)"
    )
    md.write_text(
        "# DAPO ablation ladder\n\n"
        f"Command: `{command}`\n\n"
        f"Date {made['date']}, commit {made['commit']}, machine: {made['machine']}.\n\n"
        f"Base weights: accuracy {ladder.base:.3f} on {problems} held-out problems; {paired}.\n\n"
        f"{table(ladder, gain=gain, rungs=rungs)}\n\n"
        "Columns: final accuracy is the last evaluation round (avg@k) averaged over the rung's "
        "seeds; its 95% interval comes from a two-level bootstrap (the seeds drawn with "
        "replacement, then the problems), so it holds both what varies between training runs "
        "and between evaluation problems; seeds lists each seed's own final accuracy. The "
        "comparison with the first rung is paired over problems (the same problems resampled in "
        "both, the seeds of each drawn independently). Mean gain over the budget is each round's "
        "accuracy "
        "held until the next one, averaged over the generated responses of the whole budget, "
        "minus the base: it rewards learning early, not only ending high. Responses to a target "
        "count the training responses requested until the first evaluation that many points "
        "above the common base (mean ± std over the seeds that reached it, and how many did); "
        "groups filtered is the share the gatekeeper dropped; truncated is the share of "
        "generated training responses cut at max_response_len (kept or filtered); entropy is the "
        "mean token entropy of the last tenth of training steps. Every run stops at the same "
        "sample budget.\n\n"
        f"What each rung adds:\n\n{why}\n\n"
        f"Wall time: {sum(r.wall_s for r in results) / 60:.1f} min for the {len(results)} runs "
        f"(each `dapo run` from start to exit); this invocation took {wall_s / 60:.1f} min "
        "(runs completed earlier are not redone).\n\n"
        "![curves](ablation.svg)\n"
    )
    data.write_text(
        json.dumps(
            {
                **made,
                "command": command,
                "gain": gain,
                "wall_s": wall_s,
                "base_acc": ladder.base,
                "paired": ladder.paired,
                "problems": problems,
                "rungs": [asdict(st) for st in rung_stats(ladder, rungs)],
                "runs": [r.to_json() for r in results],
            },
            indent=1,
        )
    )
    return Report(md, data, fig)


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
