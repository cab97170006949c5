"""Per-task figures of a run (issue 42) for `/status`, `/metrics`, `dapo status` and the run
summary: each task's (each `data_source`'s) counts as the gatekeeper decided its groups, the
figures derived from them over the whole run, the last step's, and each evaluation round's.

Task names come from Redis and are passed on as data: Prometheus gets them as the `task` label
(escaped by prometheus_client), never inside a metric name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from typing import Any

from contracts.tasks import TaskStats

Add = Callable[[str, str, str, Iterable[tuple[Mapping[str, str], float | None]]], None]
"""`_Page.add` of services.api.status: (kind, name, help, samples)."""

_COUNTS = (
    ("kept", "task_groups_kept", "Training groups of the task the gatekeeper kept."),
    ("filtered", "task_groups_filtered", "Training groups of the task the gatekeeper filtered."),
    ("responses", "task_responses", "Training responses of the task judged."),
    ("correct", "task_responses_correct", "Of those, the ones scored correct."),
    ("tokens", "task_response_tokens", "Response tokens of the task the model wrote."),
)
_STEP = (
    ("accuracy", "Share of the task's responses correct, over the last step's groups."),
    ("pass_rate", "Share of the task's groups the gatekeeper kept, over the last step."),
    ("response_length", "Mean response length of the task, over the last step's groups."),
)


def task_section(
    stats: Mapping[str, TaskStats], evals: list[tuple[int, dict[str, float]]]
) -> dict[str, dict[str, Any]]:
    """Each task's counts, its run-long accuracy, pass rate and mean length, and its first
    (`base_eval_acc`) and latest (`eval_acc`) evaluation accuracy."""
    base = evals[0][1] if evals else {}
    last = evals[-1][1] if evals else {}
    section: dict[str, dict[str, Any]] = {}
    for task in sorted({*stats, *last}):
        counts = stats.get(task, TaskStats())
        figures = {k.rpartition("/")[2]: v for k, v in counts.metrics(task).items()}
        section[task] = {
            **asdict(counts),
            "accuracy": figures.get("accuracy"),
            "pass_rate": figures.get("pass_rate"),
            "response_length": figures.get("response_length"),
            "base_eval_acc": base.get(task),
            "eval_acc": last.get(task),
        }
    return section


def task_families(
    add: Add, tasks: Mapping[str, Mapping[str, Any]], last: Mapping[str, Any]
) -> None:
    """Prometheus families with a `task` label: the run's counts (counters), the last step's
    figures (`task/<name>/<figure>` of the learner's metrics) and the latest evaluation."""
    for count, name, help_ in _COUNTS:
        add("counter", name, help_, [({"task": t}, row[count]) for t, row in tasks.items()])
    for figure, help_ in _STEP:
        samples = [
            ({"task": key.split("/")[1]}, _number(value))
            for key, value in last.items()
            if key.startswith("task/") and key.endswith(f"/{figure}")
        ]
        add("gauge", f"task_{figure}", help_, samples)
    add(
        "gauge",
        "task_eval_acc",
        "The task's accuracy in the latest evaluation round.",
        [({"task": t}, row["eval_acc"]) for t, row in tasks.items()],
    )


def task_lines(tasks: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """`dapo status` rows: one per task."""
    return [(f"task {name}", _line(row)) for name, row in tasks.items()]


def _line(row: Mapping[str, Any]) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    length = row["response_length"]
    return (
        f"acc {pct(row['accuracy'])} pass {pct(row['pass_rate'])} "
        f"len {'-' if length is None else f'{length:.1f}'} eval {pct(row['eval_acc'])} "
        f"({row['kept'] + row['filtered']} groups)"
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
