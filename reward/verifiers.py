"""Verifiers of docs/algorithm.md s1 and their registry:
one name per verifier, one ``Scorer`` for all.

* ``"dapo-reference"``: ``verify_dapo_reference``, the reference code's rule, quirks included;
  the one whose numbers compare with the paper's. See ``reward.rules``.
* ``"dapo-strict"`` (alias ``"dapo"``, its name before the reference rule existed):
  ``verify_dapo_strict``, the same rule with four deliberate departures (its docstring).
* ``"strict-box"``: ``verify_strict_box``; see ``reward.rules``.
* ``"first-line"`` / ``"first-number"``: a completer's answer, strict / lenient
  (``verify_first_line``, ``verify_first_number``).
* ``"math-verify"``: ``MathVerifyPool``, symbolic, in killable workers; see
  ``reward.math_verify_pool``.
* ``"reasoning-gym"``: each row's reasoning-gym task scorer, in the same killable workers; see
  ``reward.gym_checker``.
* a ``reward.function`` (``make_scorer(..., function="module:function")``): the user's own
  function in the same killable workers; see ``reward.custom``.

Only math-verify, reasoning-gym and a ``reward.function`` start processes, so close scorers
when done (or use them as context managers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol

from reward.custom import RewardFunctionChecker, parse_function_ref
from reward.gym_checker import GymChecker
from reward.math_verify_pool import MathVerifyPool, WorkerStartError
from reward.result import VerifyResult
from reward.rules import (
    verify_dapo_reference,
    verify_dapo_strict,
    verify_first_line,
    verify_first_number,
    verify_strict_box,
)
from reward.sandbox_pool import SandboxPool

__all__ = [
    "VERIFIERS",
    "VERIFIER_ALIASES",
    "InProcessScorer",
    "MathVerifyPool",
    "SandboxPool",
    "Scorer",
    "VerifyFn",
    "VerifyResult",
    "WorkerStartError",
    "canonical_verifier",
    "make_scorer",
    "verify_dapo_reference",
    "verify_dapo_strict",
    "verify_strict_box",
]

#: Valid verifier names, the default (the reference rule) first.
VERIFIERS: Final = (
    "dapo-reference",
    "dapo-strict",
    "strict-box",
    "math-verify",
    "first-line",
    "first-number",
    "reasoning-gym",
)
#: Other accepted names, and the verifier each one means. "dapo" keeps the configs written before
#: the split scoring exactly as they did.
VERIFIER_ALIASES: Final = {"dapo": "dapo-strict"}

VerifyFn = Callable[[str, str | int], VerifyResult]

_IN_PROCESS: Final[dict[str, VerifyFn]] = {
    "dapo-reference": verify_dapo_reference,
    "dapo-strict": verify_dapo_strict,
    "strict-box": verify_strict_box,
    "first-line": verify_first_line,
    "first-number": verify_first_number,
}


class Scorer(Protocol):
    """Scores batches of ``(response, ground_truth)`` pairs, results in input order.

    ``extra_info`` (one data row's ``extra_info`` per pair, or ``None``) reaches a
    ``reward.function`` and the reasoning-gym scorers; ``sources`` (each pair's ``data_source``,
    or ``None``) lets a ``reward.routing.RoutedScorer`` choose a verifier per row. A context
    manager: leaving the ``with`` block calls ``close()``.
    """

    def score_many(
        self,
        pairs: Sequence[tuple[str, str | int]],
        extra_info: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[str] | None = None,
    ) -> list[VerifyResult]: ...

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

    def score_many(
        self,
        pairs: Sequence[tuple[str, str | int]],
        extra_info: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[str] | None = None,
    ) -> list[VerifyResult]:
        """Score every pair in order (``extra_info`` and ``sources`` are not used by the
        built-in rules)."""
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


def canonical_verifier(name: str) -> str:
    """The verifier ``name`` means (``"dapo"`` -> ``"dapo-strict"``).

    Raises:
        ValueError: ``name`` is not a known verifier or alias.
    """
    name = VERIFIER_ALIASES.get(name, name)
    if name not in VERIFIERS:
        choices = ", ".join((*VERIFIERS, *VERIFIER_ALIASES))
        raise ValueError(f"unknown verifier {name!r}; choose one of {choices}")
    return name


def make_scorer(
    name: str, *, timeout_s: float = 5.0, workers: int = 2, function: str | None = None
) -> Scorer:
    """Build the scorer called ``name`` (one of ``VERIFIERS`` or ``VERIFIER_ALIASES``).

    Args:
        name: the verifier; not used when ``function`` is given.
        timeout_s: per-item hard timeout of the worker processes (math-verify, reasoning-gym,
            ``function``).
        workers: worker processes of math-verify, reasoning-gym or ``function``.
        function: a ``reward.function`` setting (``"module:function"`` or ``"file.py:function"``);
            it replaces the verifier. A relative file is read from this process's working
            directory; the sandbox workers may read that file, not its directory.

    Raises:
        ValueError: ``name`` is not a known verifier.
        reward.custom.RewardFunctionError: ``function`` is not of a valid form (no code run).
        reward.sandbox_pool.WorkerStartError: a worker could not load the function.
    """
    if function is not None:
        ref = parse_function_ref(function)  # a malformed setting fails here, before any process
        read: tuple[str, ...] = ()
        if ref.is_file:  # the workers run elsewhere: give them the file by its absolute path
            path = Path(ref.location).resolve()
            function, read = f"{path}:{ref.attribute}", (str(path),)
        try:
            return SandboxPool(
                RewardFunctionChecker(function),
                label="reward.function",
                workers=workers,
                timeout_s=timeout_s,
                read_paths=read,
            )
        except WorkerStartError as exc:  # in the user's words: the file as they wrote it
            text = str(exc)
            if ref.is_file:
                text = text.replace(function, ref.setting).replace(read[0], ref.location)
            raise WorkerStartError(text) from None
    name = canonical_verifier(name)
    if name == "math-verify":
        return MathVerifyPool(workers=workers, timeout_s=timeout_s)
    if name == "reasoning-gym":
        return SandboxPool(GymChecker(), label=name, workers=workers, timeout_s=timeout_s)
    return InProcessScorer(_IN_PROCESS[name])
