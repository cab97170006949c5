"""Tasks (issue 42): the `data.gym` config section refuses what it cannot generate, naming the
key; a row's reasoning-gym entry round-trips and a malformed one is refused; task names are safe
for metric names; per-task counts turn into the figures the learner and the API report."""

from __future__ import annotations

import json

import pytest

from contracts.config import ConfigError, GymDataSpec, build_config
from contracts.tasks import (
    GYM_ENTRY_KEY,
    GymEntry,
    TaskStats,
    eval_task_metrics,
    parse_task_stats,
    step_task_metrics,
    task_label,
)

MINIMAL = {"model": {"path": "m"}, "data": {"train_path": "t.parquet"}}


def config(gym: object, **data: object) -> object:
    return build_config({**MINIMAL, "data": {**MINIMAL["data"], "gym": gym, **data}})


def test_one_task_and_a_mixture_validate() -> None:
    one = config({"tasks": [{"task": "chain_sum", "params": {"max_terms": 3}}]})
    assert one.data.gym.tasks[0].label == "chain_sum"  # type: ignore[attr-defined]
    mix = config(
        {
            "tasks": [
                {"task": "chain_sum", "weight": 3},
                {"task": "chain_sum", "name": "chain_sum_hard", "params": {"min_digits": 3}},
                {"task": "spell_backward"},
            ],
            "answer_format": "answer-line",
            "few_shot": 2,
        }
    )
    labels = [t.label for t in mix.data.gym.tasks]  # type: ignore[attr-defined]
    assert labels == ["chain_sum", "chain_sum_hard", "spell_backward"]


@pytest.mark.parametrize(
    ("gym", "key", "reason"),
    [
        ({"tasks": []}, "data.gym.tasks", "at least 1"),
        ({"tasks": [{"task": "chain_sum"}, {"task": "chain_sum"}]}, "data.gym", "occur twice"),
        ({"tasks": [{"task": "chain_sum", "params": {"seed": 3}}]}, "params", "set by the run"),
        ({"tasks": [{"task": "Chain Sum"}]}, "data.gym.tasks.0.task", "reasoning-gym task name"),
        ({"tasks": [{"task": "x", "name": "a/b"}]}, "data.gym.tasks.0.name", "letters, digits"),
        ({"tasks": [{"task": "x", "weight": 0}]}, "data.gym.tasks.0.weight", "greater than 0"),
        ({"tasks": [{"task": "x"}], "answer_format": "boxed"}, "answer_format", "answer-tag"),
        ({"tasks": [{"task": "x", "typo": 1}]}, "data.gym.tasks.0.typo", "unknown key"),
    ],
)
def test_a_bad_gym_section_names_its_key(gym: object, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(gym)
    assert key in str(info.value) and reason in str(info.value)


def test_synth_and_gym_are_exclusive() -> None:
    with pytest.raises(ConfigError, match=r"data\.synth and data\.gym both generate"):
        config({"tasks": [{"task": "chain_sum"}]}, synth={"num_train": 10})


def test_a_fingerprint_changes_with_the_spec() -> None:
    a = GymDataSpec.model_validate({"tasks": [{"task": "chain_sum"}]})
    b = GymDataSpec.model_validate({"tasks": [{"task": "chain_sum"}], "seed": 1})
    assert a.fingerprint() == GymDataSpec.model_validate(json.loads(a.fingerprint())).fingerprint()
    assert a.fingerprint() != b.fingerprint()


def test_verifier_by_source_takes_only_known_verifiers() -> None:
    cfg = build_config({**MINIMAL, "reward": {"verifier_by_source": {"openai/gsm8k": "dapo"}}})
    assert cfg.reward.verifier_by_source == {"openai/gsm8k": "dapo"}
    with pytest.raises(ConfigError, match=r"verifier_by_source\.a"):
        build_config({**MINIMAL, "reward": {"verifier_by_source": {"a": "sympy"}}})


def test_a_gym_entry_round_trips_and_a_malformed_one_is_refused() -> None:
    entry = GymEntry("countdown", {"min_numbers": 4}, "answer-tag", "q?", {"target": 9})
    assert GymEntry.from_extra_info({GYM_ENTRY_KEY: entry.to_text()}) == entry
    assert GymEntry.from_extra_info({"index": 3}) is None
    for bad in (
        {GYM_ENTRY_KEY: {"dataset": "x"}},  # an object, not JSON text
        {GYM_ENTRY_KEY: json.dumps({"dataset": "x"})},  # fields missing
        {GYM_ENTRY_KEY: entry.to_text().replace("answer-tag", "boxed")},
        {GYM_ENTRY_KEY: entry.to_text().replace('"q?"', "7")},
    ):
        with pytest.raises(ValueError):
            GymEntry.from_extra_info(bad)


@pytest.mark.parametrize(
    ("source", "label"),
    [
        ("chain_sum", "chain_sum"),
        ("openai/gsm8k", "openai_gsm8k"),
        ("a:b c", "a_b_c"),
        ("", "unnamed"),
        ("x" * 80, "x" * 64),
    ],
)
def test_task_labels_are_safe_names(source: str, label: str) -> None:
    assert task_label(source) == label


def test_counts_become_per_task_figures() -> None:
    before = {"a": TaskStats(kept=1, filtered=1, correct=2, responses=8, tokens=40)}
    now = {
        "a": TaskStats(kept=4, filtered=2, correct=8, responses=24, tokens=200),
        "b": TaskStats(filtered=1, responses=4, tokens=4),
    }
    metrics = step_task_metrics(now, before)
    assert metrics == {
        "task/a/accuracy": pytest.approx(6 / 16),
        "task/a/response_length": pytest.approx(160 / 16),
        "task/a/pass_rate": pytest.approx(3 / 4),
        "task/b/accuracy": 0.0,
        "task/b/response_length": 1.0,
        "task/b/pass_rate": 0.0,
    }
    assert step_task_metrics(now, now) == {}  # nothing new: no figure
    assert eval_task_metrics({"a": (3, 4), "b": (0, 0)}) == {"task/a/eval_acc": 0.75}


def test_stored_counts_parse_and_garbage_is_ignored() -> None:
    raw = {
        "a:kept": 2,
        "a:correct": 5,
        "a:responses": 8,
        "b:filtered": 1,
        "a:unknown": 9,  # not a count
        "bad name:kept": 1,  # not a task label
        "c:kept": -4,  # a negative count
    }
    assert parse_task_stats(raw) == {
        "a": TaskStats(kept=2, correct=5, responses=8),
        "b": TaskStats(filtered=1),
    }
