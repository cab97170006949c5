"""The "reasoning-gym" verifier: each reasoning-gym task's own scorer, in sandbox workers
(issue 42, `data.gym`).

A reasoning-gym task scores an answer with its `score_answer(answer, entry)`, from 0 to 1. Some
of them evaluate what they read: countdown's parses the answer with SymPy's `parse_expr`, which
runs `eval`, so an answer such as `__import__('os').system(...)` is code and `9**9**9**9` a bomb.
They are untrusted code here, and run only in the sandbox workers of a
`reward.sandbox_pool.SandboxPool`: a wall-clock limit per response (`reward.timeout_s`), an
address-space cap, no network, no new process, no write outside the worker's own directory. What
the sandbox does not stop: a scorer that returns a wrong number for a crafted answer; that costs
a wrong reward, never the service.

In a worker, `GymChecker.load` imports reasoning-gym once; each job carries the row's
`contracts.tasks.GymEntry`: the answer is read from the response where its `answer_format` says
(`extract`), the task is rebuilt from its name and settings (kept per worker) and its scorer is
called on the row's question, ground truth and metadata.

The score maps to DAPO's rule reward (docs/algorithm.md s1): full marks
(`contracts.tasks.FULL_MARKS`) is correct, +1; anything else, partial credit included, -1. The
score itself is returned as the `gym_score` metric, whose mean the reward workers report.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

from contracts.tasks import FULL_MARKS, GYM_ENTRY_KEY, GymEntry
from reward.checking import Checker, CheckerLoadError, Job, Outcome
from reward.result import ERROR_PRED, INVALID
from reward.rules import extract_answer_line
from reward.text import clean_text

#: Tasks a worker keeps built (a mixture names a handful; the bound is for hostile rows).
MAX_CACHED_TASKS: Final = 64
SCORE_METRIC: Final = "gym_score"


def extract(response: str, answer_format: str, extract_tag: Any) -> str | None:
    """The answer a response gives, or None: `first-line` its first line, `answer-line` the last
    `Answer: ...` line of its last 300 characters, `answer-tag` the last `<answer>...</answer>`
    (`extract_tag`: reasoning-gym's own `extract_answer`), each stripped."""
    if answer_format == "first-line":
        answer: str | None = response.split("\n", 1)[0]
    elif answer_format == "answer-line":
        answer = extract_answer_line(response)
    else:
        answer = extract_tag(response)
    if answer is None or not answer.strip():
        return None
    return answer.strip()


class _Tasks:
    """A worker's built tasks, by name and settings; settings it refuses raise ValueError."""

    def __init__(self, rg: ModuleType) -> None:
        self.rg = rg
        self.built: dict[tuple[str, str], Any] = {}

    def get(self, entry: GymEntry) -> Any:
        key = (entry.dataset, json.dumps(entry.config, sort_keys=True))
        if key not in self.built:
            if len(self.built) >= MAX_CACHED_TASKS:
                self.built.clear()
            # size 1: the scorer needs the task's settings, not its items (some build them all).
            self.built[key] = self.rg.create_dataset(entry.dataset, **entry.config, seed=0, size=1)
        return self.built[key]


def check_entry(rg: ModuleType, tasks: _Tasks, job: Job) -> Outcome:
    """Score one job with its task's scorer; any exception becomes ``[ERROR]``.

    The worker's loop boundary for reasoning-gym's code, hence the catch-all."""
    try:
        entry = GymEntry.from_extra_info(job.extra_info)
        if entry is None:
            return Outcome(acc=False, pred=ERROR_PRED, error="the row has no reasoning-gym entry")
        answer = extract(job.response, entry.answer_format, rg.utils.extract_answer)
        item = {"question": entry.question, "answer": job.ground_truth, "metadata": entry.metadata}
        score = float(tasks.get(entry).score_answer(answer, item))
        if not math.isfinite(score):
            raise ValueError(f"{entry.dataset}'s scorer returned {score}")
        pred = INVALID if answer is None else clean_text(answer[:200])
        return Outcome(acc=score >= FULL_MARKS, pred=pred, metrics={SCORE_METRIC: score})
    except Exception as exc:  # reasoning-gym's code on untrusted text: report, never crash
        return Outcome(
            acc=False, pred=ERROR_PRED, error=f"raised {type(exc).__name__}: {exc}"[:500]
        )


@dataclass(frozen=True)
class GymChecker:
    """``CheckerSpec`` of the "reasoning-gym" verifier. The whole cleaned response travels (a
    `first-line` answer is at its start, the others at its end); of `extra_info`, only the
    reasoning-gym entry."""

    def make_job(self, response: str, ground_truth: str | int, extra_info: dict[str, Any]) -> Job:
        entry = extra_info.get(GYM_ENTRY_KEY)
        extra = {} if entry is None else {GYM_ENTRY_KEY: entry}
        return Job(clean_text(response), clean_text(str(ground_truth)), extra)

    def load(self) -> Checker:
        try:
            import reasoning_gym as rg
        except Exception as exc:  # an import may fail any way (MemoryError under the cap)
            raise CheckerLoadError(
                f"cannot import reasoning_gym ({type(exc).__name__}: {exc}): "
                "pip install 'dapo-services[gym]'"
            ) from exc
        tasks = _Tasks(rg)
        # Warm up (a task built and scored) so a first item is not charged for it.
        tasks.get(GymEntry("basic_arithmetic", {}, "first-line", "", {})).score_answer(
            "1", {"question": "", "answer": "1", "metadata": {}}
        )
        return functools.partial(check_entry, rg, tasks)
