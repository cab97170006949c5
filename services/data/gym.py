"""Training and evaluation sets generated offline from reasoning-gym tasks (`data.gym`, issue 42).

`gym_sets` draws each training row's task by the mixture's weights, takes each task's problems
from reasoning-gym with the task's settings, and writes every row in the verl format: the
prompt as chat messages (rendered for `data.gym.answer_format`, with `few_shot` solved examples),
the task's answer as `reward_model.ground_truth`, the task's name as `data_source`, and in
`extra_info` the `contracts.tasks.GymEntry` its scorer needs (`reward.gym_checker`).

Held out by construction: for task seed S (from `data.gym.seed` and the task's name), the
evaluation problems are drawn with reasoning-gym's per-item seeds S, S + 1, ... (item i of a set
seeded s is drawn with s + i), until `num_eval` distinct questions are in hand; the examples are
drawn from S + 2**20 on and the training problems from S + 2**21 on, both skipping every
evaluation question (easy settings have small problem spaces, where two draws often give one
question). The evaluation set of a task and seed is thus the same whatever `num_train` is, and a
last check removes any evaluation problem whose question occurs in training or among the
examples (none, unless the draws above are broken). Settings too narrow for the evaluation set
and the training share fail the run at start.

`prepare_gym` writes both files where they are missing or were made from another spec, another
generator or another reasoning-gym release (a `<train file>.gym.json` beside it records them); a
training file that exists without one is not ours, and is refused rather than overwritten.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import logging
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.config import ConfigError, DapoConfig, GymDataSpec, GymTaskSpec
from contracts.data import write_rows
from contracts.tasks import GYM_ENTRY_KEY, GymEntry

log = logging.getLogger(__name__)

GYM_EXTRA_HINT = "pip install 'dapo-services[gym]' (in a checkout: pip install -e '.[gym]')"
ANSWER_LINE_INSTRUCTION = 'End your reply with a line of the form "Answer: <answer>".'
"""The last line of each user turn under `answer_format: answer-line` (DAPO's `Answer:` line)."""
SPEC_SUFFIX = ".gym.json"
SHOTS_OFFSET = 1 << 20
"""Per-item seeds of a task's examples start this far above its evaluation items' ..."""
TRAIN_OFFSET = 1 << 21
"""... and its training items' this far: the three ranges never meet."""
GENERATOR_VERSION = 1
"""Recorded with the files: a change to how rows are drawn or written bumps it, and files an
older generator wrote are then written again."""
MAX_DRAWS_PER_ITEM = 20
"""Draws a task may take per item it must deliver (skipping evaluation questions, repeats):
past that its settings allow too few problems, which is said rather than looped on."""

Row = dict[str, Any]


def import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ConfigError(f"data.gym needs reasoning-gym, not installed: {GYM_EXTRA_HINT}") from exc
    return reasoning_gym


def task_seed(seed: int, label: str) -> int:
    """Task `label`'s base seed S: stable across processes (crc32, not Python's salted hash),
    below 2**31 with room for the item ranges above it (some tasks seed numpy with s + i)."""
    return (zlib.crc32(label.encode()) + seed * 7919) % (1 << 30)


def build_task(rg: Any, spec: GymTaskSpec, where: str, *, seed: int, size: int) -> Any:
    """reasoning-gym's dataset for `spec`; its refusal of the name or a setting is a ConfigError
    naming the setting (`where`, e.g. `data.gym.tasks[1]`)."""
    if spec.task not in rg.factory.DATASETS:
        raise ConfigError(f"{where}.task={spec.task!r}: reasoning-gym has no such task")
    try:
        return rg.create_dataset(spec.task, **spec.params, seed=seed, size=size)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(
            f"{where}.params={spec.params}: {spec.task} refused them: {exc}"
        ) from None


def render(question: str, shots: list[tuple[str, str]], fmt: str, rg: Any) -> list[dict[str, str]]:
    """The prompt's chat messages for `answer_format` `fmt`, after `shots` (question, answer)."""
    if fmt == "first-line":
        text = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in shots) + f"Q: {question}\nA:"
        return [{"role": "user", "content": text}]
    if fmt == "answer-line":
        turns = [(f"{q}\n\n{ANSWER_LINE_INSTRUCTION}", f"Answer: {a}") for q, a in shots]
        last = f"{question}\n\n{ANSWER_LINE_INSTRUCTION}"
        messages = []
    else:
        turns = [(q, f"<answer>{a}</answer>") for q, a in shots]
        last = question
        messages = [{"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]}]
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [*messages, {"role": "user", "content": last}]


@dataclass
class _Task:
    """One task's problems: its spec, examples, evaluation items and training items to hand out."""

    spec: GymTaskSpec
    shots: list[tuple[str, str]]
    evals: list[dict[str, Any]]
    train: Iterator[dict[str, Any]]


def _answer(item: dict[str, Any], spec: GymTaskSpec, fmt: str) -> str:
    answer = str(item["answer"])
    if fmt == "first-line" and "\n" in answer:
        raise ConfigError(
            f"data.gym: {spec.label}'s answers span several lines, which answer_format "
            "first-line cannot read: use answer-tag or answer-line"
        )
    return answer


def _row(task: _Task, item: dict[str, Any], index: int, split: str, fmt: str, rg: Any) -> Row:
    spec = task.spec
    entry = GymEntry(spec.task, dict(spec.params), fmt, item["question"], item["metadata"])
    return {
        "data_source": spec.label,
        "prompt": render(item["question"], task.shots, fmt, rg),
        "ability": "reasoning_gym",
        "reward_model": {"ground_truth": _answer(item, spec, fmt), "style": "rule"},
        "extra_info": {"index": index, "split": split, GYM_ENTRY_KEY: entry.to_text()},
    }


def mixture(spec: GymDataSpec) -> list[int]:
    """Each training row's task (an index into `spec.tasks`), drawn by the weights."""
    weights = [t.weight for t in spec.tasks]
    draw = random.Random(f"gym-mixture:{spec.seed}")
    return draw.choices(range(len(spec.tasks)), weights=weights, k=spec.num_train)


def _stream(rg: Any, spec: GymTaskSpec, where: str, seed: int, chunk: int) -> Iterator[Any]:
    """The task's items drawn with the per-item seeds seed, seed + 1, ... (in sets of `chunk`:
    some tasks build every item of a set when it is made)."""
    while True:
        items = build_task(rg, spec, where, seed=seed, size=chunk)
        yield from (items[i] for i in range(chunk))
        seed += chunk


def _take(
    stream: Iterator[Any], n: int, exclude: set[str], *, distinct: bool
) -> list[dict[str, Any]]:
    """Up to `n` items of `stream` whose question is not in `exclude` (nor, with `distinct`,
    taken already), looking at no more than MAX_DRAWS_PER_ITEM draws per item wanted."""
    out: list[dict[str, Any]] = []
    seen = set(exclude)
    draws = itertools.islice(stream, MAX_DRAWS_PER_ITEM * n + 100) if n else ()
    for item in draws:
        if item["question"] in seen:
            continue
        if distinct:
            seen.add(item["question"])
        out.append(item)
        if len(out) == n:
            break
    return out


def _task(rg: Any, spec: GymDataSpec, k: int, n_train: int) -> _Task:
    """Task k's evaluation problems (distinct), examples and training problems, the last two
    drawn past every evaluation question (module docstring)."""
    task_spec, where = spec.tasks[k], f"data.gym.tasks[{k}]"
    s = task_seed(spec.seed, task_spec.label)
    evals = _take(
        _stream(rg, task_spec, where, s, spec.num_eval), spec.num_eval, set(), distinct=True
    )
    if len(evals) < spec.num_eval:
        log.warning(
            "data.gym: %s has only %d distinct evaluation problems of the %d asked for "
            "(its settings allow few)",
            task_spec.label,
            len(evals),
            spec.num_eval,
        )
    held = {item["question"] for item in evals}
    shot_items = _take(
        _stream(rg, task_spec, where, s + SHOTS_OFFSET, max(spec.few_shot, 1)),
        spec.few_shot,
        held,
        distinct=True,
    )
    train = _take(
        _stream(rg, task_spec, where, s + TRAIN_OFFSET, max(n_train, 1)),
        n_train,
        held,
        distinct=False,
    )
    if len(shot_items) < spec.few_shot or len(train) < n_train:
        raise ConfigError(
            f"{where} ({task_spec.label}): almost every problem its settings allow is an "
            f"evaluation problem ({len(evals)} of them): widen its params or lower "
            "data.gym.num_eval"
        )
    shots = [(i["question"], _answer(i, task_spec, spec.answer_format)) for i in shot_items]
    return _Task(task_spec, shots, evals, iter(train))


def gym_sets(spec: GymDataSpec) -> tuple[list[Row], list[Row]]:
    """(training rows, evaluation rows) of `spec` (module docstring).

    Raises:
        ConfigError: reasoning-gym is missing or refuses a task or a setting, or a task's
            settings allow too few problems for its evaluation set and training share.
    """
    rg = import_reasoning_gym()
    draws = mixture(spec)
    tasks = [_task(rg, spec, k, draws.count(k)) for k in range(len(spec.tasks))]
    fmt = spec.answer_format
    train_rows = [
        _row(tasks[k], next(tasks[k].train), j, "train", fmt, rg) for j, k in enumerate(draws)
    ]
    return train_rows, _held_out(tasks, train_rows, fmt, rg)


def question_of(row: Row) -> str:
    entry = GymEntry.from_extra_info(row["extra_info"])
    assert entry is not None  # rows of `_row`
    return entry.question


def _held_out(tasks: list[_Task], train_rows: list[Row], fmt: str, rg: Any) -> list[Row]:
    """Each task's evaluation rows, without any whose question is a training question of the
    task or one of its examples (the check of what the draws already ensure), the tasks taken in
    turn: the first N problems (`eval.max_problems`) then hold every task alike."""
    kept: list[list[tuple[_Task, dict[str, Any]]]] = []
    for task in tasks:
        label = task.spec.label
        seen = {question_of(r) for r in train_rows if r["data_source"] == label}
        seen |= {q for q, _ in task.shots}
        items = [item for item in task.evals if item["question"] not in seen]
        if len(items) < len(task.evals):
            log.warning(
                "data.gym: %d of %d evaluation problems of %s also occur in training or the "
                "examples; left out",
                len(task.evals) - len(items),
                len(task.evals),
                label,
            )
        kept.append([(task, item) for item in items])
    in_turn = [pair for turn in itertools.zip_longest(*kept) for pair in turn if pair is not None]
    return [_row(task, item, i, "eval", fmt, rg) for i, (task, item) in enumerate(in_turn)]


def _installed_version() -> str | None:
    """reasoning-gym's version, without importing it (another release draws other problems)."""
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return None


def spec_path(train_path: str | Path) -> Path:
    path = Path(train_path)
    return path.with_name(path.name + SPEC_SUFFIX)


def prepare_gym(cfg: DapoConfig) -> None:
    """Write `data.train_path` and `data.eval_path` from `data.gym` where they are missing or
    were made from another spec (module docstring).

    Raises:
        ConfigError: a training file that `data.gym` did not write is in the way, or see
            `gym_sets`.
    """
    d = cfg.data
    assert d.gym is not None
    marker = spec_path(d.train_path)
    wanted = {
        "spec": json.loads(d.gym.fingerprint()),
        "eval_path": d.eval_path,
        "generator": GENERATOR_VERSION,
        "reasoning_gym": _installed_version(),
    }
    recorded = json.loads(marker.read_text()) if marker.exists() else None
    files = [Path(p) for p in (d.train_path, d.eval_path) if p]
    if recorded == wanted and all(p.exists() for p in files):
        return
    if Path(d.train_path).exists() and recorded is None:
        raise ConfigError(
            f"data.train_path={d.train_path!r} exists and was not generated from data.gym (no "
            f"{marker.name} beside it): point data.train_path at a new file, or leave data.gym out"
        )
    train_rows, eval_rows = gym_sets(d.gym)
    write_rows(d.train_path, train_rows)
    if d.eval_path:
        write_rows(d.eval_path, eval_rows)
    marker.write_text(json.dumps(wanted, sort_keys=True) + "\n")
    counts = {t.label: sum(r["data_source"] == t.label for r in train_rows) for t in d.gym.tasks}
    log.info(
        "data.gym: wrote %d training rows %s and %d evaluation rows",
        len(train_rows),
        counts,
        len(eval_rows),
    )
