"""What a reward checker is, and how it runs inside a sandbox worker (`sandbox/`).

A checker is what scores one `Job` (a response, its ground truth, the row's `extra_info`) into
an `Outcome`: math-verify (`reward.math_verify_worker.MathVerifyChecker`) or the user's
`reward.function` (`reward.custom.RewardFunctionChecker`). Its `CheckerSpec` is a frozen
dataclass of plain fields: the reward stage (`reward.sandbox_pool`) sends it as JSON to each
sandbox worker, where `serve` (the worker's factory) rebuilds it, loads the checker once and
then answers one JSON job at a time with one JSON outcome. Nothing here is pickled in either
direction, and everything a worker sends is re-validated by the parent (`outcome_of`): the
checked code runs in the worker and may write anything on the pipe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Job:
    """One item to check.

    Attributes:
        response: the response text, as the checker's spec prepared it (cut, cleaned).
        ground_truth: the ground truth as text.
        extra_info: the data row's ``extra_info`` (only ``reward.function`` reads it).
    """

    response: str
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """The answer to one ``Job``.

    Attributes:
        acc: whether the response is correct.
        pred: the prediction to report.
        error: set when the check failed (it raised, or returned something invalid); the parent
            scores the item ``[ERROR]`` with this as the reason.
        score: the score, when the checker gives one (``reward.function``); ``None`` means
            +1.0 / -1.0 from ``acc``.
        metrics: extra named values from ``reward.function``, all finite floats.
    """

    acc: bool
    pred: str
    error: str | None = None
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


Checker = Callable[[Job], Outcome]
"""Checks one job; must turn any exception of the code it calls into ``Outcome.error``."""


class CheckerLoadError(Exception):
    """The checker cannot be loaded; the worker fails its start with this message."""


class CheckerSpec(Protocol):
    """What a sandbox worker runs: a frozen dataclass of JSON fields (`spec_json`), loaded in
    each worker, used by the parent too (`make_job`)."""

    def load(self) -> Checker:
        """In the worker: import what the checker needs and return it.

        Raises:
            CheckerLoadError: the message says why it cannot be loaded.
        """
        ...

    def make_job(self, response: str, ground_truth: str | int, extra_info: dict[str, Any]) -> Job:
        """In the parent: the job to send for one item.

        Raises:
            reward.text.GroundTruthTooLong: the item is refused unsent (an ``[ERROR]`` result).
        """
        ...


def outcome_of(frame: dict[str, Any]) -> Outcome:
    """The parent's reading of a worker's outcome; ValueError if it is not one."""
    acc, pred, error, score, metrics = (
        frame.get(k) for k in ("acc", "pred", "error", "score", "metrics")
    )
    if not isinstance(acc, bool) or not isinstance(pred, str):
        raise ValueError("an outcome without a bool acc and a str pred")
    if error is not None and not isinstance(error, str):
        raise ValueError("an outcome whose error is not a str")
    if score is not None and (
        isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score)
    ):
        raise ValueError("an outcome whose score is not a finite number")
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v)
        for k, v in metrics.items()
    ):
        raise ValueError("an outcome whose metrics are not finite numbers by name")
    return Outcome(
        acc=acc,
        pred=pred[:1000],
        error=None if error is None else error[:1000],
        score=None if score is None else float(score),
        metrics={k[:100]: float(v) for k, v in list(metrics.items())[:64]},
    )


def spec_json(spec: CheckerSpec) -> str:
    """What a worker needs to rebuild `spec`: its class and its fields."""
    kind = type(spec)
    return json.dumps(
        {"spec": f"{kind.__module__}:{kind.__qualname__}", "fields": asdict(spec)}  # type: ignore[call-overload]
    )


def serve(spec_text: str) -> Callable[[str], str]:
    """The sandbox worker's factory (`sandbox.pool.Sandbox(factory_args=spec_json(spec))`):
    rebuild the spec, load its checker (its errors fail the worker's start, with their text),
    and return the function the worker calls on each job."""
    import importlib

    row = json.loads(spec_text)
    module, _, name = str(row["spec"]).partition(":")
    spec = getattr(importlib.import_module(module), name)(**row["fields"])
    check = spec.load()

    def run(job_text: str) -> str:
        job = json.loads(job_text)
        outcome = check(
            Job(str(job["response"]), str(job["ground_truth"]), dict(job["extra_info"]))
        )
        return json.dumps(asdict(outcome))

    return run
