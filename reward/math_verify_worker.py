"""The math-verify checker: the only place untrusted text meets SymPy (docs/algorithm.md s1).

``MathVerifyChecker`` is the ``CheckerSpec`` a ``reward.math_verify_pool.MathVerifyPool`` hands
to its sandbox workers (``reward.checking.serve``): in the parent it cuts each response to its
tail and checks the ground truth's length; in a worker it imports math-verify, warms it up and
checks pairs with ``check_pair``. The parent owns the clock: math-verify's own ``signal.alarm``
timeouts are switched off here on purpose.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

from reward.checking import Checker, CheckerLoadError, Job, Outcome
from reward.result import ERROR_PRED, INVALID
from reward.text import clean_text, ground_truth_text, tail

logger = logging.getLogger(__name__)

#: Characters of the response handed to math-verify (same window as the dapo verifiers).
MATH_VERIFY_TAIL_CHARS: Final = 300


def _gold_text(ground_truth: str) -> str:
    """Put a bare ground truth in a math environment so math-verify's LaTeX reader sees it."""
    if "$" in ground_truth or "\\boxed" in ground_truth:
        return ground_truth
    return f"${ground_truth}$"


def check_pair(math_verify: ModuleType, response: str, ground_truth: str) -> Outcome:
    """Parse and compare one pair with ``math_verify``; any exception becomes ``[ERROR]``.

    ``response`` is expected already cut to its tail and cleaned. This is the worker's loop
    boundary, hence the catch-all; the error text goes back to the parent, which logs it.
    """
    try:
        gold = math_verify.parse(
            _gold_text(ground_truth), parsing_timeout=None, raise_on_error=True
        )
        answer = math_verify.parse(response, parsing_timeout=None, raise_on_error=True)
        # The extracted string is the last str element; str() of a SymPy value can hang.
        pred = next((item for item in reversed(answer) if isinstance(item, str)), INVALID)
        acc = bool(math_verify.verify(gold, answer, timeout_seconds=None, raise_on_error=True))
        return Outcome(acc=acc, pred=clean_text(pred))
    except Exception as exc:  # worker loop boundary: report, never crash the worker
        return Outcome(
            acc=False, pred=ERROR_PRED, error=f"raised {type(exc).__name__}: {exc}"[:500]
        )


def _check_job(math_verify: ModuleType, job: Job) -> Outcome:
    return check_pair(math_verify, job.response, job.ground_truth)


@dataclass(frozen=True)
class MathVerifyChecker:
    """``CheckerSpec`` of the "math-verify" verifier.

    Only the last 300 characters of a response are parsed, like the "dapo" verifiers, so a 1 MB
    response costs what a 300-character one does (and travels cheaply to the worker). An
    answer that starts earlier is not seen. The ground truth is parsed whole (one over
    ``GROUND_TRUTH_MAX_CHARS`` characters is refused unsent); without ``$`` or ``\\boxed`` it is
    wrapped in ``$...$`` because math-verify only reads LaTeX inside a math environment (a bare
    ``\\sqrt{2}`` parses to nothing). ``extra_info`` is not used.

    Untrusted text reaches only ``math_verify.parse`` and ``math_verify.verify``; nothing here
    evals it, and only ``str`` values, never SymPy objects, travel back to the parent. (Inside
    math-verify, plain expressions such as ``1/2`` go to SymPy's ``parse_expr``, which does use
    ``eval``, but only after a regex has limited them to digits, dots, spaces and
    ``+-*/^()×÷``; such expressions can still be slow, e.g. ``9^9^9^9``, which the hard timeout
    covers.)
    """

    def make_job(self, response: str, ground_truth: str | int, extra_info: dict[str, Any]) -> Job:
        return Job(tail(response, MATH_VERIFY_TAIL_CHARS), ground_truth_text(ground_truth))

    def load(self) -> Checker:
        # math-verify warns once that its own timeouts are off; they are off on purpose.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        try:
            import math_verify
        except Exception as exc:  # an import may fail any way (MemoryError under the cap)
            raise CheckerLoadError(
                f"cannot import math_verify: {type(exc).__name__}: {exc}"
            ) from exc
        # Warm up (regex compilation, parser set-up: tens of ms) so a first item is not charged
        # for it against its timeout.
        check_pair(math_verify, "Answer: $\\frac{1}{2}$", "0.5")
        return functools.partial(_check_job, math_verify)
