"""Tasks (issue 42): reasoning-gym task specs, what a generated row carries for its scorer, and
the per-task statistics the gatekeeper counts and the learner, the API and the run summary report.

A *task* is the `data_source` of a prompt row: a reasoning-gym task's name in the run
(`GymTaskSpec.label`), or whatever a user's file says (`math_dapo`, `openai/gsm8k`). Per-task
metrics are named `task/<name>/<metric>`, the name made safe for every consumer (TensorBoard,
Prometheus labels, Redis hash fields) by `task_label`.

`data.gym` (`contracts.config.gym.GymDataSpec`) names one reasoning-gym task or a weighted
mixture of several; the prepare step (`services.data.prepare`) generates the training and
evaluation files from it (`services.data.gym`). Each row's `extra_info` carries a `GymEntry`
under `GYM_ENTRY_KEY`: what the task's own scorer needs, which runs in the reward stage's sandbox
(`reward.gym_checker`). A row that carries one is scored by its task's scorer unless
`reward.function` or `reward.verifier_by_source` says otherwise.

Standard library only: the reward stage's sandbox workers import this (through
`reward.gym_checker`), and every import there costs each worker's start and memory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

GYM_ENTRY_KEY = "reasoning_gym"
"""The `extra_info` field of a row generated from reasoning-gym: a `GymEntry` as JSON text (text,
not an object, so parquet never has to find one column type for every task's metadata)."""
AnswerFormat = Literal["answer-tag", "answer-line", "first-line"]
ANSWER_FORMATS: tuple[str, ...] = get_args(AnswerFormat)
"""Where a response's answer is read (`reward.gym_checker.extract`): `answer-tag`, the last
`<answer>...</answer>` (reasoning-gym's own convention); `answer-line`, the last `Answer: ...`
line of the last 300 characters (DAPO's); `first-line`, the first line (a completer's)."""
MAX_TASKS = 32
"""Distinct tasks whose statistics a run keeps; later ones are counted under `OTHER_TASK`, so a
file whose rows each carry their own `data_source` cannot grow the statistics without bound."""
OTHER_TASK = "other"
FULL_MARKS = 1.0
"""A reasoning-gym score of exactly this (or more) is a correct answer (acc True, +1); anything
below, partial credit included (countdown gives 0.05 for an expression with the wrong numbers,
spell_backward a share of the letters), is wrong (-1): DAPO's rule reward is binary, and partial
credit would let the gatekeeper keep groups whose responses are all wrong. No tolerance:
spell_backward's letter shares of a wrong answer with one letter too many add up to
0.9999999999999999, which its own code means to mark down to 0.8 and misses."""

LABEL = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
"""What a task's name in metrics may be: letters, digits, `_ . -`, 1 to 64 characters."""
_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.\-]")


def task_label(data_source: str) -> str:
    """The name a task's metrics carry: `data_source` with every character other than letters,
    digits, `_ . -` replaced by `_`, at most 64 characters (`openai/gsm8k` -> `openai_gsm8k`)."""
    if LABEL.fullmatch(data_source):
        return data_source
    return _NOT_LABEL.sub("_", data_source)[:64] or "unnamed"


# ---------------------------------------------------------------------------------------------
# What a generated row carries


@dataclass(frozen=True)
class GymEntry:
    """What a reasoning-gym task's scorer needs besides the response and the answer: its task,
    its settings, where the answer is read, and the generated entry's question and metadata."""

    dataset: str
    config: dict[str, Any]
    answer_format: str
    question: str
    metadata: dict[str, Any]

    def to_text(self) -> str:
        # Metadata values JSON cannot hold travel as their str() (none of the listed tasks has one).
        return json.dumps(asdict(self), sort_keys=True, default=str)

    @classmethod
    def from_extra_info(cls, extra_info: Mapping[str, Any]) -> GymEntry | None:
        """The row's entry; None when it has none.

        Raises:
            ValueError: the entry is there but is not one `to_text` wrote.
        """
        text = extra_info.get(GYM_ENTRY_KEY)
        if text is None:
            return None
        if not isinstance(text, str):
            raise ValueError(f"extra_info.{GYM_ENTRY_KEY} must be JSON text")
        row = json.loads(text)
        names = {f.name for f in fields(cls)}
        if not isinstance(row, dict) or set(row) != names:
            raise ValueError(f"extra_info.{GYM_ENTRY_KEY} must hold exactly {sorted(names)}")
        entry = cls(**row)
        if not (
            isinstance(entry.dataset, str)
            and isinstance(entry.config, dict)
            and isinstance(entry.question, str)
            and isinstance(entry.metadata, dict)
        ):
            raise ValueError(f"extra_info.{GYM_ENTRY_KEY} has a field of the wrong type")
        if entry.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"unknown answer_format {entry.answer_format!r}")
        return entry


# ---------------------------------------------------------------------------------------------
# Per-task statistics


@dataclass(frozen=True)
class TaskStats:
    """A task's training-lane counts as the gatekeeper decided its groups (kept or filtered),
    evaluation excluded. Kept in Redis (`Keys.task_stats`), one hash field per task and count."""

    kept: int = 0
    filtered: int = 0
    correct: int = 0
    """Responses scored correct (acc)."""
    responses: int = 0
    tokens: int = 0
    """Response tokens the model wrote (tool results excluded), for the mean length."""

    def minus(self, other: TaskStats) -> TaskStats:
        return TaskStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def metrics(self, task: str) -> dict[str, float]:
        """`task/<task>/accuracy`, `/response_length` (per response) and `/pass_rate` (kept
        groups over decided ones), each only where it has something to divide by."""
        out = {}
        if self.responses > 0:
            out[f"task/{task}/accuracy"] = self.correct / self.responses
            out[f"task/{task}/response_length"] = self.tokens / self.responses
        if self.kept + self.filtered > 0:
            out[f"task/{task}/pass_rate"] = self.kept / (self.kept + self.filtered)
        return out


TASK_STAT_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TaskStats))


def task_stat_field(task: str, stat: str) -> str:
    """The hash field of one count: `<task>:<stat>` (a task label holds no `:`)."""
    return f"{task}:{stat}"


def parse_task_stats(raw: Mapping[str, int]) -> dict[str, TaskStats]:
    """The hash's fields by task; a field of another shape is ignored (the reader counts it)."""
    counts: dict[str, dict[str, int]] = {}
    for key, value in raw.items():
        task, _, stat = key.rpartition(":")
        if stat in TASK_STAT_NAMES and LABEL.fullmatch(task) and value >= 0:
            counts.setdefault(task, {})[stat] = value
    return {task: TaskStats(**c) for task, c in sorted(counts.items())}


def step_task_metrics(
    now: Mapping[str, TaskStats], before: Mapping[str, TaskStats]
) -> dict[str, float]:
    """Each task's metrics over what the gatekeeper decided between two reads of the counts (a
    training step's worth): tasks with nothing new have no entry that step."""
    out: dict[str, float] = {}
    for task, stats in now.items():
        out |= stats.minus(before.get(task, TaskStats())).metrics(task)
    return out


def eval_task_metrics(outcomes: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """`task/<task>/eval_acc` from each task's (correct, samples) of one evaluation round."""
    return {
        f"task/{task}/eval_acc": correct / samples
        for task, (correct, samples) in sorted(outcomes.items())
        if samples > 0
    }
