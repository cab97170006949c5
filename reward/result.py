"""The result every verifier returns, and the score values (docs/algorithm.md s1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

CORRECT_SCORE: Final = 1.0
WRONG_SCORE: Final = -1.0

#: Prediction reported when no answer could be extracted.
INVALID: Final = "[INVALID]"


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one response.

    Attributes:
        score: +1.0 when correct, -1.0 otherwise (before overlong shaping, docs/algorithm.md s2).
        acc: whether the prediction matched the ground truth.
        pred: the extracted (normalised, for "dapo") prediction, or a bracketed marker:
            ``[INVALID]`` (no answer found), ``[TIMEOUT]`` or ``[ERROR]`` (math-verify).
        timeout: the verifier ran out of time on this item (math-verify only).
    """

    score: float
    acc: bool
    pred: str
    timeout: bool = False
