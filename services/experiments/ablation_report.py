"""`dapo ablate`'s report: the table of the rungs (`table`), accuracy and entropy against
generated responses (`plot`), and the three files written beside the runs (`write_report`:
`ablation.md`, `ablation.json` and `ablation.svg`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from services.experiments.ablation_ladder import LADDER, Rung
from services.experiments.ablation_stats import EARLY_GAIN, Ladder, RunResult, rung_stats
from services.experiments.provenance import provenance


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
