"""`dapo ablate`: the ladder's overrides, resuming, reading runs and the report (fake runs here;
`tests/e2e/test_ablate.py` runs the real thing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.config import load_config
from contracts.eval_stats import EVAL_ROUNDS_FILE, Round
from services.cli import main
from services.experiments.ablation import common_base, read_run, run_dir, run_ladder
from services.experiments.ablation_ladder import LADDER, NAIVE_GRPO, rung_overrides
from services.experiments.ablation_report import table, write_report
from services.experiments.ablation_stats import Ladder, rung_stats

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "ablation.yaml"


def test_the_ladder_starts_at_naive_grpo_and_ends_at_the_dapo_config() -> None:
    naive = load_config(CONFIG, [f"{k}={v}" for k, v in rung_overrides(0).items()])
    assert naive.algorithm.clip_high == naive.algorithm.clip_low == 0.2
    assert naive.algorithm.loss_agg == "seq-mean-token-mean" and not naive.algorithm.gatekeeper
    assert not naive.reward.overlong.enabled and not naive.reward.overlong.filter
    # Each rung adds exactly one technique to the one before.
    for i in range(1, len(LADDER)):
        before, now = rung_overrides(i - 1), rung_overrides(i)
        assert {k for k in now if now[k] != before[k]} == set(LADDER[i].adds)
    # The last rung is DAPO as the preset configures it,
    # plus the overlong filter the ladder kept on.
    dapo = load_config(CONFIG, [f"{k}={v}" for k, v in rung_overrides(len(LADDER) - 1).items()])
    preset = load_config(CONFIG)
    assert dapo.algorithm == preset.algorithm
    assert dapo.reward.overlong.enabled and dapo.reward.overlong.filter
    assert set(NAIVE_GRPO) == {
        k for rung in LADDER for k in rung.adds
    }  # every switch is turned back on
    # No rung skips prompts with the gatekeeper off (the config would refuse it): the GRPO rungs
    # train every group they generate.
    for i in range(len(LADDER)):
        alg = load_config(CONFIG, [f"{k}={v}" for k, v in rung_overrides(i).items()]).algorithm
        assert alg.gatekeeper or not alg.prompt_skip.enabled


def fake_run(
    path: Path,
    *,
    base: float,
    evals: list[tuple[int, float]],
    issued_per_step: int,
    steps: int,
    filtered: int = 0,
    entropy: float = 1.0,
    clip_ratio: float = 0.1,
    counters: dict[str, int] | None = None,
    problems: list[list[float]] | None = None,
) -> None:
    """What `dapo run` leaves behind, in the shape `read_run` reads. Each round's per-problem
    accuracies are `problems[i]` when given, else 4 problems at the round's accuracy."""
    path.mkdir(parents=True, exist_ok=True)
    summary = {
        "base_eval_acc": base,
        "final_eval_acc": evals[-1][1],
        "steps": steps,
        "wall_seconds": 100.0,
        "eval_history": [[s, a, 1.0] for s, a in evals],
        "interrupted": False,
        "learner_exit_code": 0,
        "ledger": {"trained": steps * 16, "filtered": filtered, "stale": 0},
        "counters": counters or {},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    records = [
        {
            "step": s,
            "ledger/issued": s * issued_per_step,
            "actor/entropy": entropy - 0.01 * s,
            "response_length/clip_ratio": clip_ratio,
        }
        for s in range(1, steps + 1)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rounds = [
        Round(step=s, rl_seconds=float(s), per_problem=tuple(problems[i] if problems else [a] * 4))
        for i, (s, a) in enumerate(evals)
    ]
    (path / EVAL_ROUNDS_FILE).write_text("".join(json.dumps(r.to_json()) + "\n" for r in rounds))


def test_a_run_is_read_into_samples_to_target_filter_share_truncation_and_final_entropy(
    tmp_path: Path,
) -> None:
    fake_run(
        tmp_path,
        base=0.2,
        evals=[(0, 0.2), (10, 0.3), (20, 0.46), (30, 0.5)],
        issued_per_step=32,
        steps=30,
        filtered=160,
        entropy=1.0,
        clip_ratio=0.25,
    )
    run = read_run(tmp_path, "dapo", 0, group_size=8, gain=0.25)
    assert run.samples_to_target == 20 * 32 * 8  # the first evaluation at >= 0.45: step 20
    assert run.samples_to_early_target == 10 * 32 * 8  # >= 0.30: step 10
    assert run.acc_curve[0] == (0.0, 0.2) and run.acc_curve[-1] == (30 * 32 * 8, 0.5)
    assert run.samples == 30 * 32 * 8
    # Averaged over the budget: rounds at 0, 10 and 20 steps each hold for a third of it (the
    # last round, at the budget's end, for none).
    assert run.mean_problems == pytest.approx([(0.2 + 0.3 + 0.46) / 3] * 4)
    assert run.filtered_share == pytest.approx(160 / (480 + 160))
    assert run.truncation_rate == pytest.approx(0.25)
    assert run.final_entropy == pytest.approx(
        1.0 - 0.01 * 29
    )  # the mean of the last tenth (steps 28-30)
    # The gatekeeper's counts cover filtered groups too (dynamic sampling drops all-wrong groups,
    # which hold most truncated responses): they take precedence over the trained responses' ratio.
    counted = tmp_path / "counted"
    fake_run(
        counted,
        base=0.2,
        evals=[(0, 0.2), (30, 0.5)],
        issued_per_step=32,
        steps=30,
        clip_ratio=0.25,
        counters={"responses_judged": 4000, "responses_truncated": 600},
    )
    assert read_run(counted, "dapo", 0, group_size=8, gain=0.25).truncation_rate == pytest.approx(
        0.15
    )
    slow = tmp_path / "slow"
    fake_run(slow, base=0.2, evals=[(0, 0.2), (30, 0.44)], issued_per_step=32, steps=30)
    assert read_run(slow, "grpo", 0, group_size=8, gain=0.25).samples_to_target is None


def test_the_table_counts_runs_that_never_reached_the_target_honestly(tmp_path: Path) -> None:
    fake_run(tmp_path / "a", base=0.2, evals=[(0, 0.2), (10, 0.5)], issued_per_step=16, steps=10)
    fake_run(tmp_path / "b", base=0.2, evals=[(0, 0.2), (10, 0.3)], issued_per_step=16, steps=10)
    fake_run(tmp_path / "c", base=0.2, evals=[(0, 0.2), (10, 0.3)], issued_per_step=16, steps=10)
    runs = [
        read_run(tmp_path / "a", "dapo", 0, group_size=8, gain=0.25),
        read_run(tmp_path / "b", "dapo", 1, group_size=8, gain=0.25),
        read_run(tmp_path / "c", "grpo", 0, group_size=8, gain=0.25),
    ]
    text = table(Ladder(runs, 0.2, True), gain=0.25)
    dapo_row = next(line for line in text.splitlines() if line.startswith("| + dynamic sampling"))
    grpo_row = next(line for line in text.splitlines() if line.startswith("| naive GRPO"))
    assert (
        "(1/2)" in dapo_row and "| 0.400 (0.300-0.500) | 0.50 0.30 |" in dapo_row
    )  # final accuracy over the 2 seeds, its interval spanning them, then each seed's
    assert "not reached (0/1)" in grpo_row
    assert (
        next(line for line in text.splitlines() if line.startswith("| + clip-higher"))
        .split("|")[2]
        .strip()
        == "0"
    )


def test_an_interrupted_ladder_resumes_without_redoing_finished_runs(tmp_path: Path) -> None:
    calls: list[Path] = []

    def runner(cmd: list[str], path: Path) -> int:
        calls.append(path)
        if len(calls) == 3:  # the third run dies half-way: it leaves a directory without a summary
            path.mkdir(parents=True)
            (path / "run.log").write_text("killed")
            return 1
        fake_run(path, base=0.2, evals=[(0, 0.2), (5, 0.3)], issued_per_step=16, steps=5)
        return 0

    rungs = LADDER[:2]
    run_ladder(
        CONFIG,
        tmp_path,
        seeds=2,
        extra={"learner.sample_budget": "640"},
        rungs=rungs,
        runner=runner,
    )
    assert len(calls) == 4
    calls.clear()
    run_ladder(
        CONFIG,
        tmp_path,
        seeds=2,
        extra={"learner.sample_budget": "640"},
        rungs=rungs,
        runner=runner,
    )
    assert calls == [run_dir(tmp_path, LADDER[1], 0)]  # only the run that had died, started afresh


def test_every_run_gets_its_rung_its_seed_and_the_budget(tmp_path: Path) -> None:
    commands: dict[str, list[str]] = {}

    def runner(cmd: list[str], path: Path) -> int:
        commands[f"{path.parent.name}/{path.name}"] = cmd
        return 1

    run_ladder(
        CONFIG,
        tmp_path,
        seeds=2,
        extra={"learner.sample_budget": "640"},
        rungs=(LADDER[0], LADDER[5]),
        runner=runner,
    )
    assert sorted(commands) == ["dapo/seed0", "dapo/seed1", "grpo/seed0", "grpo/seed1"]
    grpo, dapo = commands["grpo/seed1"], commands["dapo/seed1"]
    assert "algorithm.gatekeeper=false" in grpo and "algorithm.gatekeeper=true" in dapo
    assert {"learner.seed=1", "data.seed=1", "rollout.seed=1", "learner.sample_budget=640"} <= set(
        grpo
    )
    assert grpo[grpo.index("--output-dir") + 1] == str(tmp_path / "grpo" / "seed1")


def test_the_report_writes_the_table_the_data_and_the_plot(tmp_path: Path) -> None:
    fake_run(
        tmp_path / "r",
        base=0.2,
        evals=[(0, 0.2), (10, 0.5), (20, 0.6)],
        issued_per_step=16,
        steps=20,
    )
    runs = [read_run(tmp_path / "r", "grpo", 0, group_size=8, gain=0.25)]
    report = write_report(
        Ladder(runs, 0.2, True),
        tmp_path,
        gain=0.25,
        command="dapo ablate --config x",
        wall_s=60.0,
        rungs=LADDER[:1],
    )
    assert "| naive GRPO | 1 | 0.600 (0.600-0.600) | 0.60 |" in report.markdown.read_text()
    data = json.loads(report.data.read_text())
    assert data["runs"][0]["samples_to_target"] == 10 * 16 * 8
    assert "final_problems" not in data["runs"][0]  # the rung figures summarise them
    assert data["rungs"][0]["final"] == pytest.approx(0.6)
    assert report.figure.read_text().lstrip().startswith("<?xml")


def test_the_command_refuses_a_ladder_without_a_budget_and_unknown_rungs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["ablate", "--config", str(REPO / "configs" / "tiny.yaml"), "--out", str(tmp_path)])
        == 2
    )
    assert "no sample budget" in capsys.readouterr().err
    assert (
        main(["ablate", "--config", str(CONFIG), "--rungs", "grpo,bogus", "--out", str(tmp_path)])
        == 2
    )
    assert "unknown rung(s) ['bogus']" in capsys.readouterr().err
    assert (
        main(["ablate", "--config", str(CONFIG), "--budget-samples", "0", "--out", str(tmp_path)])
        == 2
    )
    assert "sample_budget" in capsys.readouterr().err


def test_a_ladder_whose_config_skips_prompts_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Skipping with the GRPO rungs' gatekeeper off would make them partial dynamic sampling:
    the command checks every rung's config first, so it fails at once, not in each run."""
    argv = ["ablate", "--config", str(CONFIG), "--budget-samples", "64", "--out", str(tmp_path)]
    assert main([*argv, "algorithm.prompt_skip.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.prompt_skip.enabled=true needs algorithm.gatekeeper=true" in err
    assert not any(tmp_path.iterdir())  # no run was started


def test_rungs_are_pooled_problem_by_problem_and_compared_paired_against_one_common_base(
    tmp_path: Path,
) -> None:
    """Two rungs, two seeds each, ten problems: the first rounds are identical (paired), so the
    common base is that round; a rung's final accuracy pools its seeds per problem; the
    difference between rungs resamples the same problems in both, so a gain every problem shares
    has a tight interval even though the problems' accuracies spread widely."""
    base = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    paths = []
    for rung, lift in (("grpo", 0.0), ("dapo", 0.05)):
        for seed in range(2):
            path = tmp_path / rung / f"seed{seed}"
            final = [min(1.0, b + lift + 0.02 * seed) for b in base]
            fake_run(
                path,
                base=0.45,
                evals=[(0, 0.45), (10, sum(final) / 10)],
                issued_per_step=16,
                steps=10,
                problems=[base, final],
            )
            paths.append((rung, seed, path))
    assert common_base([p for *_, p in paths]) == (pytest.approx(0.45), True)
    runs = [read_run(p, r, s, group_size=8, gain=0.25, base=0.45) for r, s, p in paths]
    grpo, dapo = rung_stats(Ladder(runs, 0.45, True), LADDER)
    assert grpo.final == pytest.approx(0.46) and grpo.vs_first is None
    assert grpo.final_ci[1] - grpo.final_ci[0] > 0.2  # the problems spread from 0.0 to 0.9
    assert dapo.vs_first == pytest.approx(0.05)  # every problem 5 points up, in both seeds
    # The interval holds the seeds' spread (their 2 points on top of the 5), not the problems'.
    assert dapo.vs_first_ci is not None
    assert 0.0 < dapo.vs_first_ci[0] < 0.05 < dapo.vs_first_ci[1] < 0.1
    # Mean gain over the budget: the base round holds for the whole budget (the final round is at
    # its end), so no rung has gained anything on average yet.
    assert dapo.mean_gain == pytest.approx(0.0)
    # Unpaired first rounds are reported as such.
    other = tmp_path / "other"
    fake_run(
        other,
        base=0.5,
        evals=[(0, 0.5), (10, 0.6)],
        issued_per_step=16,
        steps=10,
        problems=[[0.5] * 10, [0.6] * 10],
    )
    assert common_base([paths[0][2], other])[1] is False
