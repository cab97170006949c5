"""The evaluator the learner is given: it scores the staged weights on the eval set.

The learner does not know how evaluation is done (generation engine, verifier): the shell
passes `learner.service.main` a factory, and rank 0 calls it. Other ranks hold `NullEvaluator`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from torch import Tensor


class Evaluator(Protocol):
    def evaluate(self, weights: Iterable[tuple[str, Tensor]], step: int) -> dict[str, float]:
        """Metrics of the model with these weights (`eval/acc`, `eval/response_length`, ...);
        {} when there is no eval set."""
        ...

    def close(self) -> None: ...


class NullEvaluator:
    """No eval set, or a rank other than 0."""

    def evaluate(self, weights: Iterable[tuple[str, Tensor]], step: int) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
