"""The result every verifier returns, and the score values (docs/algorithm.md s1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: Scores of the built-in verifiers; an item that could not be verified scores ``WRONG_SCORE``
#: under every verifier, a ``reward.function`` included.
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
        pred: the extracted (normalised, for the "dapo" verifiers) prediction, or a bracketed
            marker: ``[INVALID]`` (no answer found), ``[TIMEOUT]`` or ``[ERROR]``.
        timeout: the verifier ran out of time on this item (math-verify, ``reward.function``).
        reason: why the item could not be verified, set with pred ``[ERROR]`` (an over-long
            ground truth, a check that raised, a worker that died) or ``[TIMEOUT]``; else
            ``None``.
        metrics: extra named values a ``reward.function`` returned (finite floats); empty for
            the built-in verifiers.
    """

    score: float
    acc: bool
    pred: str
    timeout: bool = False
    reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict, hash=False)


def error_result(reason: str) -> VerifyResult:
    """The result of an item that could not be verified: -1.0, pred ``[ERROR]``, ``reason``."""
    return VerifyResult(score=WRONG_SCORE, acc=False, pred=ERROR_PRED, reason=reason)
