"""The `data.gym` section of the config (issue 42): one reasoning-gym task or a weighted
mixture, generated offline into the run's training and evaluation files (`services.data.gym`).
Kept apart from `contracts.tasks`, which the sandbox workers import and which must not pull in
pydantic."""

from __future__ import annotations

import json
import re

from pydantic import Field, JsonValue, field_validator, model_validator

from contracts.config.base import PositiveInt, Section
from contracts.tasks import LABEL, AnswerFormat

RESERVED_PARAMS = frozenset({"seed", "size"})
"""reasoning-gym config fields the run sets itself (`GymDataSpec.seed`, the set sizes)."""
_DATASET = re.compile(r"[a-z][a-z0-9_]{0,63}")


class GymTaskSpec(Section):
    """One reasoning-gym task of `data.gym.tasks`."""

    task: str
    """The reasoning-gym task (dataset) name: `basic_arithmetic`, `chain_sum`, `products`,
    `countdown`, `gsm_symbolic`, `number_sorting`, `spell_backward`, ... (reasoning-gym 0.1.25
    has 106; `reasoning_gym.factory.DATASETS` lists them). An unknown name fails at start."""
    name: str | None = None
    """The task's name in the run: its rows' `data_source` and its metrics' middle part
    (`task/<name>/accuracy`). Letters, digits, `_ . -`. None = `task`. Two entries of one
    reasoning-gym task (different `params`) need different names."""
    weight: float = Field(1.0, gt=0)
    """Share of the training rows: each row is this task with probability weight / (the sum of
    the weights). Evaluation sets are per task and the same size for every task."""
    params: dict[str, JsonValue] = Field(default_factory=dict)
    """The task's own settings: the fields of its reasoning-gym config class (chain_sum:
    `min_terms`, `max_terms`, `min_digits`, `max_digits`; spell_backward: `min_word_len`,
    `max_word_len`). `seed` and `size` are the run's. A field the task does not have, or a value
    it refuses, fails at start with the task's own message."""

    @field_validator("task")
    @classmethod
    def _check_task(cls, value: str) -> str:
        if not _DATASET.fullmatch(value):
            raise ValueError("a reasoning-gym task name: lower-case letters, digits and _")
        return value

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and not LABEL.fullmatch(value):
            raise ValueError("letters, digits, _ . - only, 1 to 64 characters")
        return value

    @field_validator("params")
    @classmethod
    def _check_params(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        reserved = sorted(RESERVED_PARAMS & set(value))
        if reserved:
            raise ValueError(
                f"{reserved} are set by the run (data.gym.seed and the set sizes): leave them out"
            )
        return value

    @property
    def label(self) -> str:
        """The task's name in the run (`name`, else `task`)."""
        return self.name or self.task


class GymDataSpec(Section):
    """Training and evaluation sets generated offline from reasoning-gym (`data.gym`)."""

    tasks: tuple[GymTaskSpec, ...] = Field(min_length=1)
    """One task, or a weighted mixture of several."""
    num_train: PositiveInt = 20000
    """Training rows in all, each task's share drawn by its weight."""
    num_eval: PositiveInt = 100
    """Evaluation problems per task, before those that also occur in training are removed
    (counted and logged; a task left with none fails the run at start)."""
    seed: int = 0
    """Generation seed. Each task draws its evaluation problems, its few-shot examples and its
    training problems from three disjoint ranges of reasoning-gym's per-item seeds (item i of a
    set seeded s is drawn with seed s + i), so the evaluation set of a task and seed is the same
    whatever `num_train` is; evaluation problems whose question also occurs in training or among
    the examples are then removed, so the evaluation set is held out by construction."""
    answer_format: AnswerFormat = "answer-tag"
    """How the model is asked to give its answer and where the scorer reads it:
    `answer-tag` (reasoning-gym's system prompt, `<answer>...</answer>`), `answer-line` (an
    instruction to end with `Answer: ...`, DAPO's convention) or `first-line` (for a completer,
    `data.prompt_format: completion`: the examples and the question as `Q: ...` / `A: ...`
    lines, the answer is the first line of the response; pair it with `rollout.stop: ["\\n"]`)."""
    few_shot: int = Field(0, ge=0, le=16)
    """Solved examples of the same task before each question (drawn once per task, the same in
    every prompt): what shows a small model the answer's form."""

    @model_validator(mode="after")
    def _distinct_names(self) -> GymDataSpec:
        labels = [t.label for t in self.tasks]
        repeated = sorted({n for n in labels if labels.count(n) > 1})
        if repeated:
            raise ValueError(
                f"data.gym.tasks: names {repeated} occur twice; give each entry its own `name`"
            )
        return self

    def fingerprint(self) -> str:
        """The spec as canonical JSON: generated files record it, so a changed spec regenerates
        them instead of training on the old ones."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)
