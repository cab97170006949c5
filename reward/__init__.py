"""Rule-based rewards for DAPO (docs/algorithm.md s1 and s2).

Verifiers: ``verify_dapo`` (the default, Minerva normalisation), ``verify_strict_box`` and the
``MathVerifyPool`` (symbolic, in killable worker processes); ``make_scorer`` builds any of them
by name. Overlong shaping: ``overlong_penalty``, ``shaped_reward``.

Importable without torch, Redis, Ray or vLLM; math-verify is imported only inside the
math-verify worker processes.
"""

from reward.normalize import normalize_answer
from reward.overlong import overlong_penalty, shaped_reward
from reward.verifiers import (
    VERIFIERS,
    InProcessScorer,
    MathVerifyPool,
    Scorer,
    VerifyResult,
    WorkerStartError,
    make_scorer,
    verify_dapo,
    verify_strict_box,
)

__all__ = [
    "VERIFIERS",
    "InProcessScorer",
    "MathVerifyPool",
    "Scorer",
    "VerifyResult",
    "WorkerStartError",
    "make_scorer",
    "normalize_answer",
    "overlong_penalty",
    "shaped_reward",
    "verify_dapo",
    "verify_strict_box",
]
