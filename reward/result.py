"""The result every verifier returns, and the score values (docs/algorithm.md s1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

CORRECT_SCORE: Final = 1.0
WRONG_SCORE: Final = -1.0

#: Prediction reported when no answer could be extracted.
INVALID: Final = "[INVALID]"
#: Prediction reported when the item could not be verified; ``VerifyResult.reason`` says why.
ERROR_PRED: Final = "[ERROR]"


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one response.

    Attributes:
        score: +1.0 when correct, -1.0 otherwise (before overlong shaping, docs/algorithm.md s2).
        acc: whether the prediction matched the ground truth.
        pred: the extracted (normalised, for "dapo") prediction, or a bracketed marker:
            ``[INVALID]`` (no answer found), ``[TIMEOUT]`` (math-verify) or ``[ERROR]``.
        timeout: the verifier ran out of time on this item (math-verify only).
        reason: why the item could not be verified, set with pred ``[ERROR]`` (an over-long
            ground truth, a math-verify check that raised, a worker that died); else ``None``.
    """

    score: float
    acc: bool
    pred: str
    timeout: bool = False
    reason: str | None = None


def error_result(reason: str) -> VerifyResult:
    """The result of an item that could not be verified: -1.0, pred ``[ERROR]``, ``reason``."""
    return VerifyResult(score=WRONG_SCORE, acc=False, pred=ERROR_PRED, reason=reason)
