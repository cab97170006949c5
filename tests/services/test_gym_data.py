"""Sets generated from reasoning-gym (`data.gym`, issue 42): the same seed gives the same rows,
evaluation problems never occur in training or among the examples (also when the problem space
is small), a task's evaluation set does not depend on the training size, the mixture's weights
hold in the rows and in the jobs the feeder issues, each job carries its task, the files are
written once and rewritten when the spec changes, and a bad spec is refused naming its key."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contracts.bus import StreamBus, connect
from contracts.config import ConfigError, GymDataSpec, build_config, load_config
from contracts.data import load_prompts
from contracts.keys import Keys
from contracts.schemas import decode_job
from contracts.tasks import GymEntry
from learner.evaluation import eval_problems
from learner.feeder import PromptFeeder
from services.data.gym import gym_sets, mixture, prepare_gym, question_of, spec_path

pytest.importorskip("reasoning_gym")

REPO = Path(__file__).resolve().parents[2]

CHAIN = {"task": "chain_sum", "params": {"min_terms": 3, "max_terms": 3, "max_digits": 1}}
PRODUCTS = {"task": "products", "params": {"min_digits": 1, "max_digits": 1}}  # 100 questions
SPELL = {"task": "spell_backward", "params": {"min_word_len": 3, "max_word_len": 5}}


def spec(*tasks: dict[str, Any], **kw: Any) -> GymDataSpec:
    fields = {"num_train": 200, "num_eval": 20, "few_shot": 2, **kw}
    return GymDataSpec.model_validate({"tasks": list(tasks), **fields})


def questions(rows: list[dict[str, Any]], task: str) -> list[str]:
    return [question_of(r) for r in rows if r["data_source"] == task]


def shot_questions(row: dict[str, Any]) -> list[str]:
    """The examples' questions, read back from a first-line prompt's `Q:` lines."""
    text = row["prompt"][0]["content"]
    return [block.split("\nA:")[0].removeprefix("Q: ") for block in text.split("\n\n")[:-1]]


def test_the_same_seed_gives_the_same_rows_and_another_seed_others() -> None:
    s = spec(CHAIN, SPELL, answer_format="first-line")
    train, evals = gym_sets(s)
    assert gym_sets(s) == (train, evals)
    other_train, other_evals = gym_sets(s.model_copy(update={"seed": 1}))
    assert questions(other_train, "chain_sum") != questions(train, "chain_sum")
    assert questions(other_evals, "spell_backward") != questions(evals, "spell_backward")


@pytest.mark.parametrize("tasks", [(CHAIN, SPELL), (PRODUCTS,)])
def test_no_evaluation_question_is_in_training_or_the_examples(
    tasks: tuple[dict[str, Any], ...],
) -> None:
    # products of two 1-digit numbers: 100 questions, a third of them evaluation problems.
    s = spec(*tasks, num_train=400, num_eval=30, answer_format="first-line")
    train, evals = gym_sets(s)
    for task in {r["data_source"] for r in train}:
        held = questions(evals, task)
        assert len(held) == len(set(held)) == 30  # distinct, and as many as asked for
        seen = set(questions(train, task))
        seen |= set(shot_questions(next(r for r in train if r["data_source"] == task)))
        assert not seen & set(held), task
        assert len(seen) > 10  # training is not empty: the rest of the space


def test_a_tasks_evaluation_set_does_not_depend_on_the_training_size() -> None:
    small = gym_sets(spec(CHAIN, SPELL, num_train=30))[1]
    large = gym_sets(spec(CHAIN, SPELL, num_train=600))[1]
    assert small == large
    # The tasks in turn, so the first problems (eval.max_problems) hold every task alike.
    assert [r["data_source"] for r in small[:4]] == ["chain_sum", "spell_backward"] * 2


def binomial_bound(n: int, p: float, sigmas: float = 4.0) -> float:
    """Half-width of the count interval a Binomial(n, p) leaves with probability < 1e-4."""
    return sigmas * math.sqrt(n * p * (1 - p))


def test_the_mixtures_weights_hold_in_the_rows() -> None:
    s = GymDataSpec.model_validate(
        {
            "tasks": [{"task": "a", "weight": 3}, {"task": "b"}, {"task": "c", "weight": 0.5}],
            "num_train": 20_000,
        }
    )
    counts = Counter(mixture(s))
    for k, weight in enumerate((3, 1, 0.5)):
        p = weight / 4.5
        assert abs(counts[k] - s.num_train * p) < binomial_bound(s.num_train, p), (k, counts)
    assert mixture(s) == mixture(s)  # a seeded draw


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("gym"), consumer="learner")
    b.ensure_groups()
    return b


def test_each_job_carries_its_task_and_the_weights_hold_in_the_jobs(
    bus: StreamBus, tmp_path: Path
) -> None:
    s = spec({**CHAIN, "weight": 2}, SPELL, PRODUCTS, num_train=2_000, num_eval=10)
    train, _ = gym_sets(s)
    path = tmp_path / "train.parquet"
    from contracts.data import write_rows

    write_rows(path, train)
    records = load_prompts(path)  # what the learner reads
    feeder = PromptFeeder(
        records,
        SimpleNamespace(encode=lambda text, add_special_tokens: [5, 6]),
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        run_name="gym",
        limit=1_000,
        kept_ahead=1_000,
        max_prompt_len=16,
        shuffle=True,
        seed=3,
    )
    issued = feeder.admit(0)
    assert issued == 1_000
    replica = bus.as_consumer("replica")
    jobs = [decode_job(f) for _, f in replica.read(bus.keys.prompts, count=2000, block_ms=None)]
    counts = Counter(job.data_source for job in jobs)
    for task, p in (("chain_sum", 0.5), ("spell_backward", 0.25), ("products", 0.25)):
        assert abs(counts[task] - issued * p) < binomial_bound(issued, p), counts
    job = jobs[0]  # the job holds what the task's scorer needs
    entry = GymEntry.from_extra_info(job.extra_info)
    assert entry is not None and entry.dataset == job.data_source


def test_prompts_are_rendered_for_the_answer_format() -> None:
    first = gym_sets(spec(CHAIN, few_shot=2, answer_format="first-line"))[0][0]["prompt"]
    assert len(first) == 1 and first[0]["content"].startswith("Q: ")
    assert first[0]["content"].endswith("\nA:") and first[0]["content"].count("\nA:") == 3
    line = gym_sets(spec(CHAIN, few_shot=1, answer_format="answer-line"))[0][0]["prompt"]
    assert [m["role"] for m in line] == ["user", "assistant", "user"]
    assert line[1]["content"].startswith("Answer: ") and line[2]["content"].endswith('".')
    tag = gym_sets(spec(CHAIN, few_shot=1, answer_format="answer-tag"))[0][0]["prompt"]
    assert [m["role"] for m in tag] == ["system", "user", "assistant", "user"]
    assert "<answer>" in tag[0]["content"] and tag[2]["content"].startswith("<answer>")


def test_rows_read_back_with_the_tasks_entry() -> None:
    row = gym_sets(spec(CHAIN, num_train=5, num_eval=3))[1][0]
    assert row["extra_info"]["split"] == "eval" and row["ability"] == "reasoning_gym"
    entry = GymEntry.from_extra_info(row["extra_info"])
    assert entry is not None and entry.dataset == "chain_sum" and entry.config == CHAIN["params"]
    assert entry.question in row["prompt"][-1]["content"]


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"task": "no_such_task"}, r"data.gym.tasks\[0\].task='no_such_task': reasoning-gym has"),
        ({"task": "chain_sum", "params": {"max_terms": "x"}}, r"data.gym.tasks\[0\].params="),
        ({"task": "chain_sum", "params": {"colour": 1}}, r"data.gym.tasks\[0\].params="),
        (PRODUCTS, r"\(products\): almost every problem its settings allow is an evaluation"),
    ],
)
def test_a_spec_reasoning_gym_refuses_is_a_config_error(task: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        gym_sets(spec(task, num_eval=100))  # products: all 100 questions would be evaluation


def test_files_are_written_once_and_again_when_the_spec_changes(tmp_path: Path) -> None:
    tree = {
        "model": {"path": "m"},
        "data": {
            "train_path": str(tmp_path / "train.jsonl"),
            "eval_path": str(tmp_path / "eval.jsonl"),
            "gym": {"tasks": [CHAIN], "num_train": 20, "num_eval": 5},
        },
    }
    cfg = build_config(tree)
    prepare_gym(cfg)
    train = tmp_path / "train.jsonl"
    assert len(load_prompts(train)) == 20 and len(load_prompts(tmp_path / "eval.jsonl")) == 5
    written = train.stat().st_mtime_ns
    prepare_gym(cfg)
    assert train.stat().st_mtime_ns == written  # the same spec: left as it is
    tree["data"]["gym"]["num_train"] = 30  # type: ignore[index]
    prepare_gym(build_config(tree))
    assert len(load_prompts(train)) == 30

    spec_path(train).unlink()  # now it looks like a file data.gym did not write
    with pytest.raises(ConfigError, match=r"exists and was not generated from data\.gym"):
        prepare_gym(cfg)


def test_the_gym_presets_files_are_held_out(tmp_path: Path) -> None:
    """What `dapo run` writes for configs/smollm2-135m-gym.yaml: every task's evaluation
    questions are distinct, as many as asked for, and in no training row; the run's own check
    (by rendered prompt) agrees and labels the figure held-out."""
    cfg = load_config(
        REPO / "configs" / "smollm2-135m-gym.yaml",
        [f"data.train_path={tmp_path / 'train.parquet'}", f"data.eval_path={tmp_path / 'e.jsonl'}"],
    )
    assert cfg.data.gym is not None and cfg.data.eval_path is not None
    prepare_gym(cfg)
    train, evals = load_prompts(cfg.data.train_path), load_prompts(cfg.data.eval_path)
    for task in cfg.data.gym.tasks:
        held = [
            GymEntry.from_extra_info(r.extra_info) for r in evals if r.data_source == task.label
        ]
        trained = {
            e.question
            for r in train
            if r.data_source == task.label and (e := GymEntry.from_extra_info(r.extra_info))
        }
        questions_held = {e.question for e in held if e is not None}
        assert len(questions_held) == len(held) == cfg.data.gym.num_eval
        assert trained and not trained & questions_held, task.label
    _, overlap = eval_problems(cfg)
    assert overlap.shared == 0 and overlap.label == "held-out"
