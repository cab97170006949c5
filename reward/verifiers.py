"""Verifiers of docs/algorithm.md s1 and their registry: one name per verifier, one ``Scorer`` for all.

* ``verify_dapo``: the default ("dapo"), Minerva normalisation; see ``reward.rules``.
* ``verify_strict_box``: option "strict-box"; see ``reward.rules``.
* ``MathVerifyPool``: option "math-verify", symbolic, in killable workers; see
  ``reward.math_verify_pool``.

``make_scorer("dapo")`` is the default of the paper's reference run; ``"strict-box"`` and
``"math-verify"`` are the options. Only ``"math-verify"`` starts processes, so close scorers
when done (or use them as context managers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Final, Protocol

from reward.math_verify_pool import MathVerifyPool, WorkerStartError
from reward.result import VerifyResult
from reward.rules import verify_dapo, verify_strict_box

__all__ = [
    "VERIFIERS",
    "InProcessScorer",
    "MathVerifyPool",
    "Scorer",
    "VerifyFn",
    "VerifyResult",
    "WorkerStartError",
    "make_scorer",
    "verify_dapo",
    "verify_strict_box",
]

#: Valid verifier names, default first.
VERIFIERS: Final = ("dapo", "strict-box", "math-verify")

VerifyFn = Callable[[str, str | int], VerifyResult]


class Scorer(Protocol):
    """Scores batches of ``(response, ground_truth)`` pairs, results in input order.

    A context manager: leaving the ``with`` block calls ``close()``.
    """

    def score_many(self, pairs: Sequence[tuple[str, str | int]]) -> list[VerifyResult]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Scorer: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


class InProcessScorer:
    """A ``Scorer`` around a pure, in-process verify function (no resources to release)."""

    def __init__(self, verify: VerifyFn) -> None:
        self._verify = verify

    def score_many(self, pairs: Sequence[tuple[str, str | int]]) -> list[VerifyResult]:
        """Score every pair in order."""
        return [self._verify(response, truth) for response, truth in pairs]

    def close(self) -> None:
        """Nothing to release; present for the ``Scorer`` interface."""

    def __enter__(self) -> InProcessScorer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def make_scorer(name: str, *, timeout_s: float = 5.0, workers: int = 2) -> Scorer:
    """Build the scorer called ``name`` (one of ``VERIFIERS``).

    Args:
        name: ``"dapo"``, ``"strict-box"`` or ``"math-verify"``.
        timeout_s: per-item hard timeout of math-verify, seconds (ignored by the others).
        workers: math-verify worker processes (ignored by the others).

    Raises:
        ValueError: ``name`` is not a known verifier.
    """
    if name == "dapo":
        return InProcessScorer(verify_dapo)
    if name == "strict-box":
        return InProcessScorer(verify_strict_box)
    if name == "math-verify":
        return MathVerifyPool(workers=workers, timeout_s=timeout_s)
    raise ValueError(f"unknown verifier {name!r}; choose one of {', '.join(VERIFIERS)}")
