"""Rule-based rewards for DAPO (docs/algorithm.md s1 and s2), and your own reward function.

Verifiers: ``verify_dapo_reference`` (the reference rule, quirks included),
``verify_dapo_strict`` (alias "dapo": the same rule with four deliberate departures),
``verify_strict_box``, the ``MathVerifyPool`` (symbolic, in killable worker processes) and
"reasoning-gym" (each task's own scorer, in the same workers: ``reward.gym_checker``);
``make_scorer`` builds any of them by name, or runs a ``reward.function`` (``reward.custom``:
``RewardOutput`` is what such a function returns) in the same killable workers. Overlong
shaping: ``overlong_penalty``, ``shaped_reward``.

Importable without torch, Redis, Ray or vLLM; math-verify and a ``reward.function`` are
imported only inside the worker processes.
"""

from reward.custom import RewardFunctionError, RewardOutput
from reward.normalize import normalize_answer, normalize_answer_reference
from reward.overlong import overlong_penalty, shaped_reward
from reward.verifiers import (
    VERIFIER_ALIASES,
    VERIFIERS,
    InProcessScorer,
    MathVerifyPool,
    SandboxPool,
    Scorer,
    VerifyResult,
    WorkerStartError,
    make_scorer,
    verify_dapo_reference,
    verify_dapo_strict,
    verify_strict_box,
)

__all__ = [
    "VERIFIERS",
    "VERIFIER_ALIASES",
    "InProcessScorer",
    "MathVerifyPool",
    "RewardFunctionError",
    "RewardOutput",
    "SandboxPool",
    "Scorer",
    "VerifyResult",
    "WorkerStartError",
    "make_scorer",
    "normalize_answer",
    "normalize_answer_reference",
    "overlong_penalty",
    "shaped_reward",
    "verify_dapo_reference",
    "verify_dapo_strict",
    "verify_strict_box",
]
