"""The "reasoning-gym" verifier (issue 42): in the sandbox workers, each task's own scorer gives
the score reasoning-gym's `score_answer` gives, for right and wrong answers, mapped to +1 only
at full marks; a hostile answer to countdown (whose scorer evaluates it with SymPy) runs out of
time or is refused inside the sandbox, and the pool carries on; rows are routed to their
verifier by `reward.function`, `reward.verifier_by_source`, the row's entry and
`reward.verifier`, in that order."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contracts.config import DapoConfig, RewardConfig, load_config
from contracts.schemas import PromptJob, Response, RolloutGroup
from contracts.tasks import GYM_ENTRY_KEY, GymEntry
from reward.gym_checker import SCORE_METRIC, extract
from reward.result import ERROR_PRED, INVALID, VerifyResult
from reward.routing import FUNCTION, RoutedScorer, verifier_for
from reward.sandbox_pool import SandboxPool, WorkerStartError
from reward.service import open_scorer, score_group
from reward.verifiers import Scorer, make_scorer

rg = pytest.importorskip("reasoning_gym")

REPO = Path(__file__).resolve().parents[2]
TASKS = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 3, "max_digits": 2},
    "chain_sum": {"max_terms": 3, "max_digits": 2},
    "products": {"max_digits": 2},
    "countdown": {},
    "gsm_symbolic": {},
    "number_sorting": {"max_numbers": 4},
    "spell_backward": {"max_word_len": 6},
}


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    scorer = make_scorer("reasoning-gym", workers=2, timeout_s=3.0)
    assert isinstance(scorer, SandboxPool)
    with scorer:
        yield scorer


def row_of(task: str, item: dict[str, Any], fmt: str = "answer-tag") -> dict[str, Any]:
    entry = GymEntry(task, TASKS.get(task, {}), fmt, item["question"], item["metadata"])
    return {GYM_ENTRY_KEY: entry.to_text()}


def wrong_answers(answer: str) -> list[str]:
    """Near misses and garbage: partial credit for some tasks, none for others."""
    return [answer + "1", answer[:-1] or "x", f"-{answer}", "", "[ 1, 2 ]", answer.upper()]


def test_each_scorer_agrees_with_reasoning_gyms_own(pool: SandboxPool) -> None:
    cases: list[tuple[str, dict[str, Any], str, float]] = []
    for task, params in TASKS.items():
        items = rg.create_dataset(task, seed=11, size=4, **params)
        for i in range(len(items)):
            item = items[i]
            for answer in [item["answer"], *wrong_answers(item["answer"])]:
                cases.append((task, item, answer, items.score_answer(answer or None, item)))
    responses = [f"Let me think.\n<answer>{answer}</answer>" for _, _, answer, _ in cases]
    results = pool.verify_many(
        [(text, item["answer"]) for text, (_, item, _, _) in zip(responses, cases, strict=True)],
        [row_of(task, item) for task, item, _, _ in cases],
    )
    assert pool.errors == 0 and pool.timeouts == 0
    for (task, _, answer, own), result in zip(cases, results, strict=True):
        assert result.metrics[SCORE_METRIC] == pytest.approx(own), (task, answer)
        # Full marks is right (+1); anything less, partial credit included, is wrong (-1).
        assert result.acc is (own == 1.0) and result.score == (1.0 if own == 1.0 else -1.0)
    # Both outcomes occur for every task, and so does partial credit (countdown's 0.05 for the
    # wrong numbers, spell_backward's share of letters, ...).
    assert {t for (t, *_), r in zip(cases, results, strict=True) if r.acc} == set(TASKS)
    assert {t for (t, *_), r in zip(cases, results, strict=True) if not r.acc} == set(TASKS)
    assert {round(own, 2) for *_, own in cases if 0 < own < 1} >= {0.01, 0.05}


@pytest.mark.parametrize(
    ("response", "fmt", "answer"),
    [
        (" 42\nQ: next", "first-line", "42"),
        ("\n42", "first-line", None),
        ("work\nAnswer: 7\nAnswer:  8 ", "answer-line", "8"),
        ("no line", "answer-line", None),
        ("<answer>1</answer> then <answer> 2 </answer>", "answer-tag", "2"),
        ("<answer></answer>", "answer-tag", None),
    ],
)
def test_the_answer_is_read_where_the_format_says(
    response: str, fmt: str, answer: str | None
) -> None:
    assert extract(response, fmt, rg.utils.extract_answer) == answer


def countdown_row() -> tuple[dict[str, Any], dict[str, Any]]:
    items = rg.create_dataset("countdown", seed=5, size=1)
    return items[0], row_of("countdown", items[0])


def test_countdowns_scorer_runs_what_it_reads_outside_a_sandbox(tmp_path: Path) -> None:
    """Why it runs in one: reasoning-gym's own scorer executes the answer."""
    marker = tmp_path / "ran"
    code = (
        "import reasoning_gym as rg; d = rg.create_dataset('countdown', seed=5, size=1); "
        f"d.score_answer(\"__import__('pathlib').Path('{marker}').touch()\", d[0])"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True)
    assert marker.exists()


def test_a_hostile_countdown_answer_stays_in_the_sandbox(pool: SandboxPool, tmp_path: Path) -> None:
    item, row = countdown_row()
    written, spawned = tmp_path / "written", tmp_path / "spawned"
    hostile = [
        f"__import__('pathlib').Path('{written}').write_text('x')",
        f"__import__('os').system('touch {spawned}')",
        "9**9**9**9",  # SymPy evaluates the power tower: out of time, not out of the service
    ]
    before = pool.timeouts
    results = pool.verify_many(
        [(f"<answer>{h}</answer>", item["answer"]) for h in hostile]
        + [(f"<answer>{item['answer']}</answer>", item["answer"])],
        [row] * 4,
    )
    assert not written.exists() and not spawned.exists()
    assert [r.acc for r in results] == [False, False, False, True]
    assert results[2].timeout and results[2].pred == "[TIMEOUT]" and pool.timeouts == before + 1
    # The pool replaced the killed worker and goes on scoring.
    [again] = pool.verify_many([(f"<answer>{item['answer']}</answer>", item["answer"])], [row])
    assert again.acc


def test_a_row_without_an_entry_or_with_a_bad_one_is_an_error(pool: SandboxPool) -> None:
    _, row = countdown_row()
    bad_entry = {GYM_ENTRY_KEY: row[GYM_ENTRY_KEY].replace("countdown", "no_such_task")}
    results = pool.verify_many([("<answer>1</answer>", "1")] * 2, [{}, bad_entry])
    assert [r.pred for r in results] == [ERROR_PRED, ERROR_PRED]
    assert "no reasoning-gym entry" in (results[0].reason or "")
    assert "no_such_task" in (results[1].reason or "")


# --- routing ------------------------------------------------------------------------------------


def test_each_row_gets_the_verifier_the_rule_names() -> None:
    gym_row = {GYM_ENTRY_KEY: "{}"}
    rw = RewardConfig(verifier="first-line", verifier_by_source={"gsm8k": "first-number"})
    assert verifier_for(rw, "gsm8k", gym_row) == "first-number"  # by source first
    assert verifier_for(rw, "chain_sum", gym_row) == "reasoning-gym"  # then the row's entry
    assert verifier_for(rw, "math", {}) == "first-line"  # then reward.verifier
    assert verifier_for(RewardConfig(verifier="dapo"), "math", {}) == "dapo-strict"  # canonical
    with_function = rw.model_copy(update={"function": "m:f"})
    assert verifier_for(with_function, "gsm8k", gym_row) == FUNCTION  # over everything


class Broken:
    def __call__(self, name: str) -> Scorer:
        if name == "reasoning-gym":
            raise WorkerStartError("cannot import reasoning_gym")
        return make_scorer(name)


def test_a_verifier_that_cannot_start_for_an_unannounced_row_costs_only_that_row() -> None:
    rw = RewardConfig(verifier="first-line", verifier_by_source={"n": "first-number"})
    with RoutedScorer(rw, Broken(), start=["first-line"]) as scorer:
        results = scorer.score_many(
            [("7", "7"), ("x 7", "7"), ("<answer>7</answer>", "7")],
            [{}, {}, {GYM_ENTRY_KEY: "{}"}],
            ["a", "n", "chain_sum"],
        )
        assert [r.acc for r in results] == [True, True, False]
        assert results[2].pred == ERROR_PRED and "could not start" in (results[2].reason or "")
        assert set(scorer.scorers) == {"first-line", "first-number"}
    with pytest.raises(WorkerStartError):  # announced: it stops the service at start
        RoutedScorer(rw, Broken(), start=["first-line", "reasoning-gym"])


@pytest.fixture(scope="module")
def cfg() -> DapoConfig:
    return load_config(REPO / "configs" / "tiny.yaml")


class CharTokenizer:
    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return ["".join(map(chr, row)) for row in ids]


def test_the_reward_stage_scores_a_gym_group_with_its_task(cfg: DapoConfig) -> None:
    items = rg.create_dataset("chain_sum", seed=2, size=1, **TASKS["chain_sum"])
    row = row_of("chain_sum", items[0], fmt="first-line")
    job = PromptJob(
        group_id="g-1",
        prompt_index=0,
        prompt_ids=[1],
        ground_truth=items[0]["answer"],
        data_source="chain_sum",
        issued_version=0,
        issued_at=0.0,
        extra_info=row,
    )
    texts = [f" {items[0]['answer']}\n", " 1000\n", "\n"]
    responses = [
        Response(token_ids=[ord(c) for c in t], logprobs=[-1.0] * len(t), finish_reason="stop")
        for t in texts
    ]
    group = RolloutGroup(job=job, policy_version=0, replica_id="r0", responses=responses)
    with open_scorer(cfg.reward, workers=1, gym=True) as scorer:  # the run's own scorer
        assert isinstance(scorer, RoutedScorer) and "reasoning-gym" in scorer.scorers
        scored, results = score_group(group, CharTokenizer(), scorer, cfg)
    assert scored.acc == [True, False, False]
    assert scored.preds == [items[0]["answer"], "1000", INVALID]
    assert all(isinstance(r, VerifyResult) and SCORE_METRIC in r.metrics for r in results)
