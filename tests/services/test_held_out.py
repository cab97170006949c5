"""Evaluation sets are held out by construction: every preset's generated evaluation file shares
no fact with its training file nor with what the tiny base was warm-started on, and a user's
evaluation rows that training also holds are counted, labelled and (on request) left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import services.data.prepare as prepare_step
from contracts.config import load_config
from contracts.data import write_rows
from contracts.heldout import held_out_problems
from learner.evaluation import eval_problems
from services.demo.synthetic import DIFFICULTY_LEVELS, fact_key, fact_split, synth_rows

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(
    p.name for p in (REPO / "configs").glob("*.yaml") if load_config(p).data.synth is not None
)


def _facts(rows: list[dict]) -> set[tuple[int, ...]]:
    return {fact_key(r["extra_info"]["numbers"]) for r in rows}


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTY_LEVELS))
def test_the_split_is_by_fact_so_no_seed_or_size_crosses_it(difficulty: int) -> None:
    train = synth_rows(3000, difficulty=difficulty, seed=7, split="train")
    evals = synth_rows(60, difficulty=difficulty, seed=8, split="eval")
    assert not _facts(train) & _facts(evals)
    # a + b and b + a are one fact, on one side
    for row in evals:
        assert fact_split(difficulty, list(reversed(row["extra_info"]["numbers"]))) == "eval"


def test_an_eval_split_draws_distinct_facts_while_there_are_some() -> None:
    evals = synth_rows(500, difficulty=1, seed=3, split="eval")
    assert len(_facts(evals)) == 500


@pytest.mark.parametrize("preset", PRESETS)
def test_every_presets_files_are_disjoint(
    preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `dapo run` writes for the preset (its training file, its evaluation file) and what
    its tiny base learns from and is picked on share no fact."""
    cfg = load_config(REPO / "configs" / preset)
    d = cfg.data
    assert d.synth is not None and d.eval_path
    train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    cfg = cfg.model_copy(
        update={
            "data": d.model_copy(
                update={"train_path": str(train_path), "eval_path": str(eval_path)}
            )
        }
    )
    prepare_step.prepare_data(cfg)
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()]  # noqa: E731
    eval_facts = _facts(read(eval_path))
    assert len(eval_facts) >= min(d.synth.num_eval, 9)  # level 0 has only 9 held-out facts
    assert not _facts(read(train_path)) & eval_facts
    base_rows = prepare_step._base_train_rows(cfg) + prepare_step._base_selection_rows(cfg)
    base_facts = {fact_key(r["extra_info"]["numbers"]) for r in base_rows}
    assert not base_facts & eval_facts
    _, overlap = eval_problems(cfg)
    assert overlap.shared == 0 and overlap.label == "held-out"


def _rows(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "answer": str(i), "fact": p.split()[-1]} for i, p in enumerate(prompts)]


def test_user_rows_seen_in_training_are_counted_and_dropped_on_request(tmp_path: Path) -> None:
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    write_rows(train, _rows(["what is 1", "what is 2", "what is 3"]))
    write_rows(evals, _rows(["what is 2", "what is 9", "so what is 3", "what is 4"]))
    problems, overlap = held_out_problems(evals, train)
    assert (len(problems), overlap.shared) == (4, 1)
    assert overlap.label == "in-distribution (1 of 4 problems also in training)"
    problems, overlap = held_out_problems(evals, train, drop=True)
    assert [p.messages[0]["content"] for p in problems] == [
        "what is 9",
        "so what is 3",
        "what is 4",
    ]
    assert overlap.label == "held-out"
    # by a key naming what could be memorised: "so what is 3" is the fact "3" again
    from contracts.data import ColumnMap

    columns = ColumnMap(extra_keys=("fact",))
    problems, overlap = held_out_problems(evals, train, columns=columns, key="fact", drop=True)
    assert [p.messages[0]["content"] for p in problems] == ["what is 9", "what is 4"]
    # without a training file (an evaluation-only machine) nothing is compared
    problems, overlap = held_out_problems(evals, tmp_path / "absent.jsonl")
    assert (len(problems), overlap.shared) == (4, 0)
